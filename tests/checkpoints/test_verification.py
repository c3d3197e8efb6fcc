"""Checkpoint verification that scales: which rank hashes which file, how the ranks' tables
merge into a manifest, what a rank hashes on resume, and manifests of the wrong structure
refused with a UserError naming the file and the key. In one process; no launches."""

from __future__ import annotations

import hashlib
import json
import os
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from acc_train import UserError
from acc_train.accelerator import ENV_TIMEOUT, collective_timeout_handler
from acc_train.config import LaunchConfig
from acc_train.checkpoint.hashing import (
    MANIFEST,
    StreamHashes,
    assign_files,
    file_table,
    hash_files,
    hash_rank_files,
    list_files,
    merge_tables,
    unchanged,
    writer_rank,
)
from acc_train.checkpoint.manifest import find_problems, read_manifest, verify_checkpoint, write_json
from pydantic import ValidationError

from tests.conftest import run_cli

SHA_A = hashlib.sha256(b"a").hexdigest()


def make_checkpoint(root: Path, files: dict[str, bytes]) -> Path:
    """A checkpoint directory with ``files`` and a manifest listing them, as today's save writes it."""
    root.mkdir(parents=True)
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    write_json(root / MANIFEST, {"format": "dcp", "portable": "state", "step": 4, "world_size": 2, "files": file_table(root)})
    return root


# --- which rank hashes what ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "rank"),
    [
        ("rng-rank00000.json", 0),
        ("rng-rank00001.safetensors", 1),
        ("optimizer-rank00003.json", 3),
        ("state/shard-00001-model-00001-of-00001.safetensors", 0),  # DCP: shard index = rank + 1
        ("state/shard-00002-model-00001-of-00001.safetensors", 1),
        ("trainer_state.json", None),
        ("deepspeed/state/mp_rank_00_model_states.pt", None),
        ("rank000001.bin", None),  # six digits: not the five acc-train writes
    ],
)
def test_writer_rank_reads_the_rank_a_file_is_named_by(name: str, rank: int | None) -> None:
    assert writer_rank(name) == rank


def test_assign_files_gives_ranked_files_to_their_rank_and_spreads_the_rest_by_bytes() -> None:
    sizes = {
        "rng-rank00000.json": 10,
        "rng-rank00001.json": 10,
        "state/shard-00001-model-00001-of-00001.safetensors": 500,
        "state/shard-00002-model-00001-of-00001.safetensors": 400,
        "trainer_state.json": 50,
        "model_config.json": 20,
        "big.bin": 300,
        "rng-rank00005.json": 10,  # a rank this world lacks: spread like the rest
    }
    shares = assign_files(sizes, 2)
    assert sorted(n for share in shares for n in share) == sorted(sizes), "every file exactly once"
    assert len({n for share in shares for n in share}) == len(sizes)
    assert {"rng-rank00000.json", "state/shard-00001-model-00001-of-00001.safetensors"} <= set(shares[0])
    assert {"rng-rank00001.json", "state/shard-00002-model-00001-of-00001.safetensors"} <= set(shares[1])
    assert "big.bin" in shares[1]  # rank 1 held fewer bytes
    load = [sum(sizes[n] for n in share) for share in shares]
    assert abs(load[0] - load[1]) <= 300
    assert assign_files(dict(reversed(sizes.items())), 2) == shares, "the same on every rank, whatever the order"


def test_assign_files_on_one_rank_hashes_everything() -> None:
    assert [sorted(share) for share in assign_files({"a": 1, "rng-rank00003.json": 2}, 1)] == [["a", "rng-rank00003.json"]]


# --- the ranks' tables merged into the manifest -------------------------------------------


def test_rank_tables_merge_into_the_same_table_one_process_writes(tmp_path: Path) -> None:
    ckpt = tmp_path / "staging"
    for name, data in {"rng-rank00000.json": b"0", "rng-rank00001.json": b"11", "state/a.safetensors": b"x" * 5000, "t.json": b"{}"}.items():
        (ckpt / name).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / name).write_bytes(data)
    listing = list_files(ckpt)
    tables = [hash_files(ckpt, share) for share in assign_files(listing, 2)]
    assert all(tables)
    assert merge_tables(tables, listing) == file_table(ckpt)
    assert list(merge_tables(reversed(tables), listing)) == sorted(listing)


def test_merge_refuses_a_file_no_rank_hashed_or_one_that_changed(tmp_path: Path) -> None:
    listing = {"a": 1, "b": 1}
    with pytest.raises(RuntimeError, match="b: not hashed by any rank"):
        merge_tables([{"a": {"size": 1, "sha256": SHA_A}}], listing)
    with pytest.raises(RuntimeError, match="a: 1 bytes hashed, 2 listed"):
        merge_tables([{"a": {"size": 1, "sha256": SHA_A}}], {"a": 2})
    with pytest.raises(RuntimeError, match="c: hashed but not in the checkpoint"):
        merge_tables([{"a": {"size": 1, "sha256": SHA_A}, "c": {"size": 1, "sha256": SHA_A}}], {"a": 1})
    with pytest.raises(RuntimeError, match="a: hashed twice with different results"):
        merge_tables([{"a": {"size": 1, "sha256": SHA_A}}, {"a": {"size": 1, "sha256": "0" * 64}}], {"a": 1})


def test_a_file_hashed_right_after_writing_is_hashed_again_if_it_changed(tmp_path: Path) -> None:
    (tmp_path / "rng-rank00001.json").write_bytes(b"first")
    (tmp_path / "rng-rank00000.json").write_bytes(b"rank 0's")
    (tmp_path / "rng-rank00001.safetensors").write_bytes(b"streamed")
    early = hash_rank_files(tmp_path, 1, skip={"rng-rank00001.safetensors"})
    assert list(early) == ["rng-rank00001.json"], "only the files named by this rank, less those it has"
    listing = list_files(tmp_path)
    assert unchanged(tmp_path, early, listing) == hash_files(tmp_path, ["rng-rank00001.json"])
    assert unchanged(tmp_path, early, {}) == {}, "a file not in the listing is not kept"
    (tmp_path / "rng-rank00001.json").write_bytes(b"second, longer")  # e.g. another writer finished it later
    assert unchanged(tmp_path, early, listing) == {}, "changed since: hashed again with the rest"


def test_stream_hashes_hash_what_dcp_writes_as_it_is_written(tmp_path: Path) -> None:
    import torch
    from acc_train.checkpoint.portable import write_portable_state

    outside = StreamHashes.wrap_active(object())
    assert type(outside) is object, "no recording, no wrapping"
    with StreamHashes.recording(tmp_path) as streamed:
        write_portable_state(tmp_path, {"w": torch.arange(1000.0)}, {"w": {"exp_avg": torch.ones(1000)}})
    written = {n: s for n, s in list_files(tmp_path).items() if n.endswith(".safetensors")}
    assert written, list_files(tmp_path)
    assert unchanged(tmp_path, streamed.entries, written) == hash_files(tmp_path, written)


def test_a_stream_that_seeks_or_fails_records_nothing(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystem

    with StreamHashes.recording(tmp_path) as streamed:
        fs = StreamHashes.wrap_active(FileSystem())
    with fs.create_stream(tmp_path / "plain.bin", "wb") as stream:
        stream.write(b"head")
        stream.write(memoryview(bytearray(b"-tail")))
        assert stream.tell() == 9
    with fs.create_stream(tmp_path / "seeks.bin", "wb") as stream:
        stream.write(b"xxxx")
        stream.seek(0)
        stream.write(b"y")
    with pytest.raises(ValueError, match="boom"), fs.create_stream(tmp_path / "fails.bin", "wb") as stream:
        stream.write(b"part")
        raise ValueError("boom")
    with fs.create_stream(tmp_path / "plain.bin", "rb") as stream:
        assert stream.read() == b"head-tail"
    assert {name: entry for name, (_, entry) in streamed.entries.items()} == hash_files(tmp_path, ["plain.bin"])


# --- what each rank checks on resume ------------------------------------------------------


def test_each_rank_hashes_only_its_share_and_together_they_hash_every_file(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "step-000004", {"rng-rank00000.json": b"0", "rng-rank00001.json": b"1", "state/s.safetensors": b"s" * 100})
    (ckpt / "rng-rank00001.json").write_bytes(b"2")  # same size, other content
    manifest = read_manifest(ckpt)
    sizes = {n: e["size"] for n, e in manifest["files"].items()}
    shares = assign_files(sizes, 2)
    found = [find_problems(ckpt, manifest, hashes=set(share)) for share in shares]
    assert found[0] == [], "rank 0 does not hash rank 1's file"
    assert found[1] == ["rng-rank00001.json: content differs from the manifest (sha256)"]
    assert find_problems(ckpt, manifest, hashes=False) == [], "sizes alone do not see it"
    with pytest.raises(UserError, match="rng-rank00001.json: content differs"):
        verify_checkpoint(ckpt)  # one process (checkpoint inspect) hashes everything


def test_every_rank_checks_sizes_and_unlisted_files_whatever_its_share(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "step-000004", {"a.bin": b"aa", "b.bin": b"bb"})
    (ckpt / "a.bin").write_bytes(b"a")
    (ckpt / "planted.bin").write_bytes(b"x")
    (ckpt / "state").mkdir()
    (ckpt / "state" / MANIFEST).write_text("{}")  # only the top-level manifest is exempt
    problems = find_problems(ckpt, read_manifest(ckpt), hashes=set())
    assert problems == ["a.bin: 1 bytes, the manifest says 2", "planted.bin: not in the manifest", f"state/{MANIFEST}: not in the manifest"]


def test_a_manifest_written_before_this_change_still_verifies(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-000002"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text('{"step": 2}')
    old = {  # as main's file_table wrote it: every file, {size, sha256}, keys sorted by path
        "format": "dcp", "portable": "state", "step": 2, "epoch": 0, "samples_in_epoch": 8, "world_size": 2,
        "strategy": "ddp", "data": {"seed": 42}, "model": {"model_type": "llama", "config_sha256": "ab"},
        "files": {"trainer_state.json": {"size": 11, "sha256": hashlib.sha256(b'{"step": 2}').hexdigest()}},
    }  # fmt: skip
    (ckpt / MANIFEST).write_text(json.dumps(old, indent=1))
    assert verify_checkpoint(ckpt) == old


# --- manifests of the wrong structure -----------------------------------------------------

GOOD_ENTRY = {"size": 1, "sha256": SHA_A}


@pytest.mark.parametrize(
    ("content", "named"),
    [
        (b"[1, 2]", "a JSON list, not an object"),
        (b'"files"', "a JSON str, not an object"),
        (b"{}", "key ['files']: Field required"),
        (b'{"files": ["a"]}', "key ['files']: Input should be a valid dictionary"),
        (b'{"files": {"a": 3}}', "key ['files']['a']: Input should be a valid dictionary"),
        (b'{"files": {"a": "x"}}', "key ['files']['a']"),
        (b'{"files": {"a": {"size": "1", "sha256": "%s"}}}' % SHA_A.encode(), "key ['files']['a']['size']: Input should be a valid integer"),
        (b'{"files": {"a": {"size": -1, "sha256": "%s"}}}' % SHA_A.encode(), "key ['files']['a']['size']"),
        (b'{"files": {"a": {"size": 1}}}', "key ['files']['a']['sha256']: Field required"),
        (b'{"files": {"a": {"size": 1, "sha256": 5}}}', "key ['files']['a']['sha256']"),
        (b'{"files": {"a": {"size": 1, "sha256": "nothex"}}}', "key ['files']['a']['sha256']"),
        (b'{"files": {"a": {"size": NaN, "sha256": "%s"}}}' % SHA_A.encode(), "key ['files']['a']['size']"),
        (b'{"files": {}, "world_size": "2"}', "key ['world_size']: Input should be a valid integer"),
        (b'{"files": {}, "world_size": 0}', "key ['world_size']"),
        (b'{"files": {}, "world_size": true}', "key ['world_size']"),
        (b'{"files": {}, "step": 1.5}', "key ['step']"),
        (b'{"files": {}, "step": [3]}', "key ['step']"),
        (b'{"files": {}, "format": 7}', "key ['format']"),
        (b'{"files": {}, "portable": ["state"]}', "key ['portable']"),
        (b'{"files": {}, "data": [1]}', "key ['data']"),
        (b'{"files": {}, "model": "llama"}', "key ['model']"),
        (b'{"files": {"../outside": {"size": 1, "sha256": "%s"}}}' % SHA_A.encode(), "key ['files']['../outside']: not a relative path"),
        (b'{"files": {"/etc/passwd": {"size": 1, "sha256": "%s"}}}' % SHA_A.encode(), "key ['files']['/etc/passwd']"),
        (b"\xff\xfe{}", "not UTF-8 text (byte 0)"),
        (b'{"files": {', "not JSON (Expecting property name enclosed in double quotes, line 1, column 12)"),
        (b"[" * 100_000 + b"]" * 100_000, "manifest"),  # too deep for the JSON reader
        (b"", "not JSON"),
    ],
)
def test_a_manifest_of_the_wrong_structure_is_a_user_error_naming_the_file_and_key(tmp_path: Path, content: bytes, named: str) -> None:
    ckpt = tmp_path / "step-000001"
    ckpt.mkdir()
    (ckpt / MANIFEST).write_bytes(content)
    with pytest.raises(UserError) as info:
        verify_checkpoint(ckpt)
    assert named in str(info.value)
    assert info.value.where == str(ckpt / MANIFEST)


def test_a_valid_manifest_keeps_its_other_keys(tmp_path: Path) -> None:
    ckpt = tmp_path / "c"
    ckpt.mkdir()
    (ckpt / "a").write_bytes(b"a")
    doc = {"files": {"a": GOOD_ENTRY}, "versions": {"torch": "2.13"}, "strategy_options": None, "step": 0, "world_size": 1}
    (ckpt / MANIFEST).write_text(json.dumps(doc))
    assert verify_checkpoint(ckpt) == doc


def test_a_manifest_that_cannot_be_read_is_a_user_error(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    ckpt = tmp_path / "c"
    ckpt.mkdir()
    (ckpt / MANIFEST).write_text("{}")
    (ckpt / MANIFEST).chmod(0)
    with pytest.raises(UserError, match="cannot be read"):
        verify_checkpoint(ckpt)


# --- the collective timeout the ranks' hashing runs under ---------------------------------


@pytest.mark.parametrize("bad", [0, -5, float("inf"), float("nan"), "soon", 8 * 24 * 3600])
def test_launch_timeout_is_a_positive_finite_number_of_seconds(bad: object) -> None:
    with pytest.raises(ValidationError, match="timeout"):
        LaunchConfig(timeout=bad)
    assert LaunchConfig().timeout == 1800


def test_the_job_or_the_launcher_names_the_timeout_accelerate_gets(monkeypatch: pytest.MonkeyPatch) -> None:
    job = SimpleNamespace(config=SimpleNamespace(launch=LaunchConfig(timeout=90)))
    assert collective_timeout_handler(job).timeout.total_seconds() == 90
    monkeypatch.delenv(ENV_TIMEOUT, raising=False)
    assert collective_timeout_handler(None) is None, "outside acc-train: Accelerate's own default"
    monkeypatch.setenv(ENV_TIMEOUT, "600")
    handler = collective_timeout_handler(None)
    assert handler.to_kwargs()["timeout"].total_seconds() == pytest.approx(600, abs=0.01), "not dropped as Accelerate's default"


@pytest.mark.launch
def test_launch_timeout_reaches_the_process_group(tmp_path: Path) -> None:
    script = tmp_path / "timeout_script.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, torch, torch.distributed as dist
            from acc_train import Accelerator

            acc = Accelerator()
            seconds = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            with open(os.path.join(os.environ["OUT_DIR"], f"rank{acc.process_index}.txt"), "w") as f:
                f.write(str(seconds))
            """
        )
    )
    proc = run_cli("--set", "launch.timeout=1234", "launch", "--num-processes", "2", str(script), env={"OUT_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [float((tmp_path / f"rank{r}.txt").read_text()) for r in (0, 1)] == [1234.0, 1234.0]


CHECK_SCRIPT = textwrap.dedent(
    """
    import json, os
    from pathlib import Path
    import torch
    from acc_train import Accelerator, UserError
    from acc_train.checkpoint import CheckpointManager, DCPFormat, TrainerState

    class NoSchedule:
        def state_dict(self):
            return {}

    acc = Accelerator()
    out = Path(os.environ["OUT_DIR"])
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    model.weight.grad = torch.ones_like(model.weight)
    optimizer.step()
    manager = CheckpointManager(acc, out / "run", DCPFormat(), keep_last=None, manifest_extra={}, data_signature={}, seed=0)
    manager.save(model, optimizer, NoSchedule(), TrainerState(step=1))
    path = out / "run" / "checkpoints" / "step-000001"
    if acc.is_main_process:  # rank 1's own file, in rank 1's share only: same size, other content
        f = path / "rng-rank00001.json"
        data = f.read_bytes()
        f.write_bytes(data[:-2] + (b"0" if data[-2:-1] != b"0" else b"1") + data[-1:])
    acc.wait_for_everyone()
    try:
        manager.check(path, model)
        outcome = "accepted"
    except UserError as exc:
        outcome = str(exc)
    (out / f"rank{acc.process_index}.txt").write_text(outcome)
    """
)


@pytest.mark.launch
def test_every_rank_refuses_a_file_only_one_rank_hashed(tmp_path: Path) -> None:
    """Saved by two ranks (the portable state hashed as it was written), the checkpoint verifies
    in one process; a file edited in rank 1's share is refused by rank 0 too."""
    script = tmp_path / "check_script.py"
    script.write_text(CHECK_SCRIPT)
    proc = run_cli("--strategy", "ddp", "launch", "--num-processes", "2", str(script), env={"OUT_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = tmp_path / "run" / "checkpoints" / "step-000001"
    manifest = json.loads((ckpt / MANIFEST).read_text())
    assert {"rng-rank00000.json", "rng-rank00001.json", "trainer_state.json"} <= set(manifest["files"])
    assert any(name.startswith("state/shard-00002-") for name in manifest["files"]), manifest["files"]
    outcomes = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert outcomes[0] == outcomes[1], outcomes
    assert "rng-rank00001.json: content differs from the manifest (sha256)" in outcomes[0]
    with pytest.raises(UserError, match="rng-rank00001.json: content differs"):
        verify_checkpoint(ckpt)
    (ckpt / "rng-rank00001.json").unlink()  # everything else is as saved: the one-process hashes agree
    manifest["files"].pop("rng-rank00001.json")
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    assert verify_checkpoint(ckpt)["world_size"] == 2
