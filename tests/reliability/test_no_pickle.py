"""No pickle on our channels.

Statically: no module of ours imports a pickle-family deserializer, and
``torch.load`` is only ever called with ``weights_only=True``. At run time: the
step messages, a model runner's step on a real checkpoint and a whole
scheduler loop run with every pickle entry point patched to raise.

(Ray's own control plane — actor arguments, Serve's proxy-to-replica hop — uses
its own serialization; that is Ray's boundary, hardened in docs/reliability.md.)
"""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

from iterserve.scheduler import (
    FakeExecutor,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    codec,
)
from iterserve.scheduler.messages import StepPlan, StepResult

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("scheduler", "workers", "cluster", "kernels", "client")
FORBIDDEN = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}


def findings(source: str, name: str = "<source>") -> list[str]:
    """Everything in ``source`` that could deserialize with pickle."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names if _forbidden(a.name)]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [a.name for a in node.names]
            found += [f"{where} from {node.module} import" for n in names[:1] if _forbidden(n)]
            found += [f"{where} import {n}" for n in names[1:] if _forbidden(n)]
        elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN | {"read_pickle"}:
            found.append(f"{where} .{node.attr}")
        elif isinstance(node, ast.Call):
            found += _bad_call(node, where)
    return found


def _forbidden(module: str) -> bool:
    return any(part in FORBIDDEN for part in module.split("."))


def _bad_call(node: ast.Call, where: str) -> list[str]:
    func = ast.unparse(node.func)
    keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
    strings = [a.value for a in node.args if isinstance(a, ast.Constant)]
    if func.endswith("torch.load") and keywords.get("weights_only") != "True":
        return [f"{where} {func} without weights_only=True"]
    if func.split(".")[-1] == "load" and keywords.get("allow_pickle") == "True":
        return [f"{where} {func}(allow_pickle=True)"]
    if func in ("__import__", "importlib.import_module", "import_module"):
        return [f"{where} {func}({s!r})" for s in strings if isinstance(s, str) and _forbidden(s)]
    return []


def test_the_scanner_sees_every_way_in():
    bad = """
import pickle
import cloudpickle as cp
from ray import cloudpickle
from joblib import load
import marshal, shelve
x = ray.cloudpickle.loads(b"")
torch.load(f)
torch.load(f, weights_only=False)
np.load(f, allow_pickle=True)
__import__("dill")
importlib.import_module("pickle")
pandas.read_pickle(f)
"""
    assert len(findings(bad)) == 13, findings(bad)  # one per way in; two on the marshal line
    assert findings("torch.load(f, weights_only=True)\nimport msgpack\nnp.load(f)") == []


def test_no_module_of_ours_can_unpickle():
    files = [p for folder in SCANNED for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(files) > 40, "the scan found too few files"
    found = [f for p in files for f in findings(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == []


@pytest.fixture
def no_pickle(monkeypatch):
    """Every pickle entry point raises for the duration of a test."""
    forbid_pickle(monkeypatch)


def forbid_pickle(monkeypatch):
    """Every pickle entry point raises from now on, until the test ends."""

    def refuse(*args, **kwargs):
        raise AssertionError("pickle was used to deserialize")

    class Refusing(pickle.Unpickler):
        def __init__(self, *args, **kwargs):
            refuse()

    for module in (pickle, __import__("_pickle")):
        monkeypatch.setattr(module, "loads", refuse)
        monkeypatch.setattr(module, "load", refuse)
        monkeypatch.setattr(module, "Unpickler", Refusing)


def wire(message):
    """One trip across the actor boundary: encode, then decode as the receiver would."""
    return codec.decode(codec.encode(message), type(message))


def test_the_patch_bites(no_pickle):
    with pytest.raises(AssertionError, match="pickle"):
        pickle.loads(pickle.dumps(1))


def test_step_messages_decode_without_pickle(no_pickle):
    from tests.workers.plan_driver import PlanDriver

    class NoRunner:
        block_size = 4

    driver = PlanDriver(NoRunner())
    driver.add("r0", [1, 2, 3, 4, 5], SamplingParams(temperature=0.5, seed=3, logprobs=2))
    plan = driver.plan()
    assert wire(plan) == plan
    result = FakeExecutor(vocab_size=100, block_size=4).execute(wire(plan))
    assert wire(result) == result


def test_a_model_runner_step_runs_without_pickle(tiny_model_dir, monkeypatch):
    """Steps, once the runner is warm. The cpu backend's kernels are compiled on first
    use, or loaded from numba's on-disk cache, whose index numba reads with pickle: a
    local code cache the process writes itself, like Python's bytecode, not a channel;
    so one step runs before pickle is refused."""
    from iterserve.workers.runner import ModelRunner
    from tests.workers.plan_driver import GREEDY, PlanDriver

    class OverTheWire:  # the runner as a rank sees it: plans and results as bytes
        def __init__(self, runner):
            self.runner, self.block_size = runner, runner.block_size

        def execute(self, plan: StepPlan) -> StepResult:
            return wire(self.runner.execute(wire(plan)))

    runner = ModelRunner(tiny_model_dir, dtype="float32", num_kv_blocks=64, block_size=4)
    warm = PlanDriver(runner)
    warm.add("warm", [1, 5, 9, 40, 2], GREEDY)  # a prefill piece, then decode rows
    warm.run()
    forbid_pickle(monkeypatch)
    driver = PlanDriver(OverTheWire(runner))
    driver.add("r0", [1, 5, 9, 40], GREEDY)
    driver.add("r1", [1, 7, 7], GREEDY)
    outputs = driver.run()
    assert [len(tokens) for tokens in outputs.values()] == [GREEDY.max_tokens] * 2


def test_a_scheduler_and_fake_executor_loop_runs_without_pickle(no_pickle):
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=32, block_size=4, max_model_len=64, num_kv_blocks=64
    )
    scheduler = Scheduler(config)
    fake = FakeExecutor(vocab_size=500, output_len=None, block_size=4)
    params = SamplingParams(max_tokens=12)
    for i in range(6):
        scheduler.add_request(Request(f"r{i}", [3 + i] * (5 + i), params))
    outputs: dict[str, list[int]] = {}
    while scheduler.has_work:
        step = scheduler.schedule(now=0.0)
        assert isinstance(step.plan, StepPlan)
        for out in scheduler.update(wire(fake.execute(wire(step.plan)))).outputs:
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        scheduler.check_integrity()
    assert outputs == {f"r{i}": fake.expected_output(f"r{i}", params)[0] for i in range(6)}
