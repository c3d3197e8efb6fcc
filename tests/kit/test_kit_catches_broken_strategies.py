"""The kit fails, with a clear message, on a deliberately broken strategy: its own tests.

``broken-dp`` is a real installed plugin (a dist-info on ``PYTHONPATH``, so the launched workers
find it too) that gets these things wrong: its options schema allows unknown keys; it registers
but never syncs (it skips DDP's gradient all-reduce), so its ranks diverge, yet it declares itself
equivalent to DDP; its ranks having drifted apart, it still checkpoints one copy of what it takes
for replicated state, so a resume cannot reproduce the run and the exported model is not the
checkpointed one; and the effect its tests state (``allreduce_buckets``) is a constant that
counts nothing. The same plugin registers two strategies that train correctly but
report falsely: ``broken-fallback`` says it is Accelerate's FSDP yet accepts the silent fallback
to DDP that Accelerate makes on CPU, and ``broken-replica`` says it shards its parameters yet
holds a whole replica on every rank, and shows none of the effect its tests state.
The kit runs on them (and on a name nothing registers) in a separate pytest session, and each
defect must fail its own test with a message that says what is wrong, while the rest pass. To
keep the launches few, the two false reporters skip the resume test (a second launch each,
which checks nothing their defects touch).
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("acc-train-kit-selftest")]

BROKEN = '''
from pydantic import ConfigDict

from acc_train import Strategy, StrategyOptions, StrategyPlanner, hookimpl


class LooseOptions(StrategyOptions):
    model_config = ConfigDict(extra="allow", strict=True, frozen=True)  # broken: unknown keys pass


class BrokenDP(Strategy):
    name = "broken-dp"
    description = "deliberately broken, for the conformance kit's own tests"
    options_schema = LooseOptions
    checkpoint_format = "dcp"  # broken: one copy of replicated state, though the ranks differ

    def accelerator_kwargs(self, job):
        return {}

    def planner(self):
        return BrokenDPPlanner(self)

    def summary(self, accelerator):
        return {"allreduce_buckets": 3}  # broken: a constant, not a count of anything it did


class BrokenDPPlanner(StrategyPlanner):
    def equivalent_to_ddp(self):
        return True  # broken: it does not all-reduce gradients


class FallbackFSDP(Strategy):
    name = "broken-fallback"
    description = "claims FSDP, runs DDP on CPU"
    accelerate_distributed_types = ("FSDP",)  # it says it is Accelerate's FSDP...

    def accelerator_kwargs(self, job):
        return {}  # broken: ...but never switches Accelerate's state, so on CPU it runs as DDP

    def expected_distributed_types(self):
        return {"FSDP", "MULTI_CPU"}  # broken: accepts the fallback instead of refusing it


class ReplicatingShards(Strategy):
    name = "broken-replica"
    description = "claims sharding, replicates"

    def accelerator_kwargs(self, job):
        return {}  # broken: plain DDP, the whole model on every rank...

    def planner(self):
        return ShardsPlanner(self)


class ShardsPlanner(StrategyPlanner):
    def parameter_shards(self, machine):
        return machine.world_size  # ...though it claims each rank holds 1/N of it


@hookimpl
def acc_train_register_strategies(register):
    register(BrokenDP())
    register(FallbackFSDP())
    register(ReplicatingShards())


@hookimpl
def acc_train_train_start(run):
    if isinstance(run.job.strategy, BrokenDP) and hasattr(run.model, "register_comm_hook"):
        from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

        run.model.register_comm_hook(None, noop_hook)
'''

SUITE = '''
import pytest

from acc_train.testing import TestStrategyConformance  # noqa: F401

pytestmark = pytest.mark.acc_train_strategy(
    "broken-dp", "broken-fallback", "broken-replica", "no-such-strategy",
    effects={"broken-dp": "allreduce_buckets", "broken-replica": "shard_gathers"},  # what each claims to do of its own
)
'''


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """test id -> (passed | failed | skipped, failure message) of the kit's session."""
    root = tmp_path_factory.mktemp("kit-selftest")
    site = root / "site"
    dist = site / "broken_dp-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-dp\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[acc_train]\nbroken-dp = broken_dp_plugin\n")
    (site / "broken_dp_plugin.py").write_text(BROKEN)
    project = root / "project"
    project.mkdir()
    (project / "test_broken.py").write_text(SUITE)
    report = root / "report.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-o", "addopts=", "--rootdir", str(project),
         f"--junitxml={report}", "-k", "not (stop_and_resume and (fallback or replica))", "test_broken.py"],
        capture_output=True, text=True, cwd=project, env=env, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-2000:]  # 1: tests ran, some failed
    results = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        failed = case.find("failure")
        if failed is None:
            failed = case.find("error")
        status = "failed" if failed is not None else "skipped" if case.find("skipped") is not None else "passed"
        results[case.get("name")] = (status, (failed.get("message") or "") if failed is not None else "")
    return results


#: (strategy, kit test, what its failure message must say): each defect fails its own test
DEFECTS = [
    ("broken-dp", "test_options_schema_rejects_unknown_keys", 'the options schema of "broken-dp" accepted the unknown key strategy.no_such_option_kit'),
    ("broken-dp", "test_stop_and_resume_reproduces_the_uninterrupted_run", "the checkpoint does not hold everything training depends on"),
    ("broken-dp", "test_losses_match_ddp_where_declared_equivalent", '"broken-dp" declares itself equivalent to DDP, but at step'),
    ("broken-dp", "test_exported_model_holds_the_checkpointed_weights", "differs from the step-12 checkpoint's: the exported model is not the trained one"),
    ("broken-fallback", "test_runs_as_the_distributed_type_it_claims", "processes ran as MULTI_CPU: it silently fell back to another distributed type"),
    ("broken-replica", "test_each_rank_holds_the_parameter_share_it_claims", "it replicates the model instead of sharding it"),
    ("broken-dp", "test_ranks_hold_the_same_parameters", "the ranks' parameters diverge"),
    ("broken-dp", "test_its_distinguishing_effect_shows_in_run_json", "it does not count the strategy's work in a launch"),
    ("broken-replica", "test_its_distinguishing_effect_shows_in_run_json", "shows no such key: the effect is absent"),
]


@pytest.mark.parametrize("strategy", ["broken-dp", "broken-fallback", "broken-replica"])
def test_what_each_broken_strategy_gets_right_passes(outcomes: dict[str, tuple[str, str]], strategy: str) -> None:
    defects = {test for name, test, _ in DEFECTS if name == strategy}
    ran = {name.split("[")[0]: result for name, result in outcomes.items() if name.endswith(f"[{strategy}]")}
    assert len(ran) >= 10, sorted(ran)  # every kit test but, for the false reporters, the deselected resume
    for test, (status, text) in ran.items():
        if test not in defects:
            assert status in ("passed", "skipped"), (strategy, test, text)
    assert ran["test_trains_on_two_cpu_processes"][0] == "passed", ran["test_trains_on_two_cpu_processes"]


@pytest.mark.parametrize(("strategy", "test", "message"), DEFECTS, ids=[f"{s}-{t.removeprefix('test_')}" for s, t, _ in DEFECTS])
def test_each_defect_fails_its_own_test_with_a_clear_message(outcomes: dict[str, tuple[str, str]], strategy: str, test: str, message: str) -> None:
    status, text = outcomes[f"{test}[{strategy}]"]
    assert status == "failed" and message in text, (status, text)


def test_a_strategy_nothing_registers_fails_every_check_by_name(outcomes: dict[str, tuple[str, str]]) -> None:
    checks = {name: result for name, result in outcomes.items() if name.endswith("[no-such-strategy]")}
    assert len(checks) == 11 and all(status == "failed" for status, _ in checks.values()), checks
    assert 'strategy "no-such-strategy" is not registered' in checks["test_registers_and_lists[no-such-strategy]"][1]
    assert 'unknown strategy "no-such-strategy"' in checks["test_options_schema_rejects_unknown_keys[no-such-strategy]"][1]
