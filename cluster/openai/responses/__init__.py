"""The Responses API (Open Responses, as OpenAI's client speaks it): POST
/v1/responses and GET/DELETE /v1/responses/{id} (:mod:`.serving`)."""

from .serving import ResponsesServing, add_responses_routes

__all__ = ["ResponsesServing", "add_responses_routes"]
