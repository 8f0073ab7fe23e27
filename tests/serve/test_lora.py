"""LoRA adapters through the real server, with vLLM's interface: adapters from the
config and loaded at runtime serve transformers + peft's greedy tokens, mixed in
one engine with the base model; /v1/models lists them with their parent; bad
adapters are refused with a 400 naming the problem and nothing is loaded."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest

from tests.serve.conftest import deploy, engine_replicas, undeploy

pytest.importorskip("peft")

APP = "lora"
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def peft_adapters(tiny_model_dir, tmp_path_factory):
    """``name -> (path, peft model)`` for three adapters of the tiny Llama."""
    import transformers

    from tests.workers.lora_adapters import build_peft_model, save_adapter

    base = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    base.config._attn_implementation = "eager"
    out = {"base": (None, base)}
    for i, name in enumerate(["qv8", "all16", "kup64"]):
        model = build_peft_model(base, name, seed=20 + i)
        out[name] = (save_adapter(model, tmp_path_factory.mktemp(name)), model)
    return out


@pytest.fixture(scope="module")
def lora_url(serve_url, tiny_model_dir, peft_adapters):
    config = dict(
        dtype="float32",
        kernel_backend="cpu",
        max_model_len=128,
        num_kv_blocks=256,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=32,  # prompts in pieces beside other rows' decodes
        num_cpus_per_worker=0.1,
        torch_threads=1,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=64,
        lora_modules={"qv8": str(peft_adapters["qv8"][0])},
    )
    yield deploy(serve_url, APP, model=str(tiny_model_dir), config=config)
    undeploy(APP)


@pytest.fixture
def http(lora_url):
    with httpx.Client(base_url=lora_url, timeout=120) as client:
        yield client


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                             dtype=torch.long), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def body(model: str, prompt: list[int], n: int = 12) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}  # fmt: skip


def token_ids(choice: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


PROMPTS = [[5, 17, 99, 23, 8, 41, 77, 3, 12, 60, 31], [200, 14, 9], [33] * 21, [7, 250, 1, 64]]


def load(http, name, path) -> httpx.Response:
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def test_an_adapter_from_the_config_serves_peft_greedy_tokens(http, peft_adapters):
    model = peft_adapters["qv8"][1]
    r = http.post("/v1/completions", json=body("qv8", PROMPTS[0]))
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "qv8"
    assert token_ids(r.json()["choices"][0]) == greedy_reference(model, PROMPTS[0], 12)
    base = http.post("/v1/completions", json=body(MODEL, PROMPTS[0])).json()
    assert token_ids(base["choices"][0]) != token_ids(r.json()["choices"][0])


def test_adapters_loaded_at_runtime_mixed_with_the_base_model_keep_their_tokens(
    http, lora_url, peft_adapters
):
    """Four models (base and three adapters, two adapter slots) at once, several
    prompts each, concurrently: every answer is its own model's greedy tokens."""
    for name in ("all16", "kup64"):
        r = load(http, name, peft_adapters[name][0])
        assert r.status_code == 200, r.text
    names = [MODEL, "qv8", "all16", "kup64"]
    refs = {MODEL: peft_adapters["base"][1]}
    refs.update({n: peft_adapters[n][1] for n in names[1:]})

    async def run_all():
        async with httpx.AsyncClient(base_url=lora_url, timeout=300) as client:
            jobs = [(name, p) for name in names for p in PROMPTS]
            answers = await asyncio.gather(
                *(client.post("/v1/completions", json=body(name, p)) for name, p in jobs)
            )
            return list(zip(jobs, answers))

    for (name, prompt), r in asyncio.run(run_all()):
        assert r.status_code == 200, r.text
        got = token_ids(r.json()["choices"][0])
        assert got == greedy_reference(refs[name], prompt, 12), (name, prompt)
    stats = asyncio.run(engine_replicas(APP, "stats"))[0]
    assert stats["lora_resident"] <= 2
    assert stats["lora_evictions"] >= 1  # three adapters through two slots


def test_models_lists_adapters_with_their_parent(http):
    data = http.get("/v1/models").json()["data"]
    ids = [m["id"] for m in data]
    assert ids[0] == MODEL and "qv8" in ids
    card = next(m for m in data if m["id"] == "qv8")
    assert card["parent"] == MODEL
    assert http.get("/v1/models/qv8").json()["id"] == "qv8"


def test_unload_then_requests_naming_it_are_404(http, peft_adapters, tmp_path):
    path = tmp_path / "again"
    shutil.copytree(peft_adapters["qv8"][0], path)
    assert load(http, "temp", path).status_code == 200
    assert http.post("/v1/completions", json=body("temp", [1, 2, 3], 2)).status_code == 200
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "temp"})
    assert r.status_code == 200, r.text
    r = http.post("/v1/completions", json=body("temp", [1, 2, 3], 2))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "temp"})
    assert r.status_code == 404


@pytest.mark.parametrize(
    "change, words",
    [
        ("missing", "not a directory"),
        ("rank", "r=128 is over max_lora_rank 64"),
        ("target", "unknown target modules ['embed_tokens']"),
        ("shape", "do not match the base model's projection"),
    ],
)
def test_a_bad_adapter_is_a_400_naming_the_problem_and_nothing_is_loaded(
    http, peft_adapters, tmp_path, change, words
):
    path = tmp_path / "bad"
    shutil.copytree(peft_adapters["qv8"][0], path)
    config = json.loads((path / "adapter_config.json").read_text())
    if change == "missing":
        path = tmp_path / "nowhere"
    elif change == "rank":
        config["r"] = 128
    elif change == "target":
        config["target_modules"] = ["q_proj", "embed_tokens"]
    elif change == "shape":
        from safetensors.torch import load_file, save_file

        tensors = load_file(path / "adapter_model.safetensors")
        tensors = {k: v[:, :-1].contiguous() if "lora_A" in k else v for k, v in tensors.items()}
        save_file(tensors, path / "adapter_model.safetensors")
    if change != "missing":
        (path / "adapter_config.json").write_text(json.dumps(config))
    r = load(http, "bad", path)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
    assert "bad" not in [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert http.post("/v1/completions", json=body("bad", [1, 2], 2)).status_code == 404


def test_load_refuses_missing_fields_and_duplicate_names(http, peft_adapters):
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = load(http, "qv8", peft_adapters["qv8"][0])
    assert r.status_code == 400 and "loaded already" in r.json()["error"]["message"]
    r = load(http, MODEL, peft_adapters["qv8"][0])
    assert r.status_code == 400 and "base model" in r.json()["error"]["message"]


def test_the_sdk_loads_lists_uses_and_unloads_an_adapter(lora_url, peft_adapters, tmp_path):
    from iterserve_client import AsyncClient, BadRequestError, Client, NotFoundError

    with Client(lora_url, timeout=120) as client:
        assert "added" in client.load_lora_adapter("sdk", str(peft_adapters["all16"][0]))
        card = next(m for m in client.models() if m.id == "sdk")
        assert card.parent == MODEL and card.root == str(peft_adapters["all16"][0])
        out = client.completions.create(model="sdk", prompt=PROMPTS[1], max_tokens=4,
                                        temperature=0, ignore_eos=True)  # fmt: skip
        assert out.model == "sdk" and out.usage.completion_tokens == 4
        with pytest.raises(BadRequestError, match="not a directory"):
            client.load_lora_adapter("broken", str(tmp_path / "nowhere"))

    async def unload():
        async with AsyncClient(lora_url, timeout=120) as client:
            assert "removed" in await client.unload_lora_adapter("sdk")
            with pytest.raises(NotFoundError):
                await client.unload_lora_adapter("sdk")

    asyncio.run(unload())
