"""The ``checkpoint`` and ``launch`` sections of the job config."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from acc_train.config.base import MAX_PROCESSES_PER_MACHINE, Count, NonEmptyStr, NonNegativeCount, Section

__all__ = ["CheckpointConfig", "LaunchConfig"]


class CheckpointConfig(Section):
    every: NonNegativeCount = Field(100, description="Save every N steps (and after the last); 0 saves only after the last step.")
    keep_last: Count | None = Field(2, description="Keep the N most recent complete checkpoints; null keeps all.")
    async_save: bool = Field(
        False,
        description=(
            "Write the state in a background thread (torch.distributed.checkpoint's async_save): the loop "
            "blocks only while it is copied aside. The checkpoint is committed (manifest, `latest`) once "
            "written, at the next save or the end of training. `dcp` format only."
        ),
    )


class LaunchConfig(Section):
    """How the workers start; keys left unset here fill themselves from Slurm or torchrun's
    variables (``acc_train.launch.cluster``, docs/cluster.md) before the job is validated."""

    num_processes: int | None = Field(
        None,
        ge=1,
        le=MAX_PROCESSES_PER_MACHINE,
        description="Processes per machine. Null: one per GPU, or 1 on a machine without GPUs.",
    )
    num_machines: Count = Field(1, description="Machines taking part; filled from Slurm or torchrun's variables when unset.")
    machine_rank: NonNegativeCount = Field(
        0,
        description="This machine's rank, 0 to `num_machines` - 1; filled from the cluster's variables when unset.",
    )
    main_process_ip: NonEmptyStr | None = Field(None, description="Address of machine 0; required with several machines.")
    main_process_port: int = Field(
        29500,
        ge=1,
        le=65535,
        description="Port of machine 0's rendezvous; under Slurm, 20000 + job id % 10000 when unset.",
    )
    rdzv_backend: Literal["static", "c10d"] = Field(
        "static",
        description="`static` (fixed machine ranks) or `c10d` (elastic rendezvous).",
    )
    max_restarts: NonNegativeCount = Field(
        0,
        description=(
            "Restart every worker after a failure up to N times; the restarted workers resume from the latest"
            " complete checkpoint."
        ),
    )
    timeout: float = Field(
        1800.0,
        gt=0,
        le=7 * 24 * 3600,
        allow_inf_nan=False,
        description=(
            "Seconds a collective waits for the slowest rank before the run fails (the process group's "
            "timeout): longer than any phase one rank runs while the others wait."
        ),
    )
    rendezvous_timeout: float = Field(
        900.0,
        gt=0,
        le=7 * 24 * 3600,
        allow_inf_nan=False,
        description="Seconds a machine waits at the rendezvous for the others to join (several machines).",
    )
    save_signals: list[Literal["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"]] = Field(
        default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"],
        description=(
            "Signals on which the workers save a checkpoint at the next step boundary and stop (the command "
            "exits 128 + the signal's number): SIGTERM (Kubernetes' eviction, Slurm at preemption or the time"
            " limit), SIGINT (Ctrl-C), SIGUSR1 (Slurm's `--signal=USR1@SECONDS`). Empty: a signal stops the "
            "run without saving."
        ),
    )
    shutdown_timeout: int = Field(
        30,
        ge=1,
        le=24 * 3600,
        description=(
            "Seconds between the launcher passing a signal on to the workers and killing them (torch "
            "elastic's `shutdown_timeout`): room for the rest of a step and one checkpoint write."
        ),
    )
    requeue: bool = Field(
        False,
        description=(
            "Under Slurm (a job submitted with `--requeue`): once a signal's checkpoint is saved, ask Slurm to "
            "requeue the job (`scontrol requeue $SLURM_JOB_ID`); the requeued job runs the same command, which "
            "continues the run (needs `resume: auto`)."
        ),
    )

    @model_validator(mode="after")
    def _rank_in_range(self) -> LaunchConfig:
        if self.num_machines > 1 and not self.main_process_ip:
            raise ValueError(
                "with several machines, launch.main_process_ip (--main-process-ip) must name machine 0 "
                "(under Slurm, or with MASTER_ADDR set, it is detected)"
            )
        if self.machine_rank >= self.num_machines:
            raise ValueError(
                f"launch.machine_rank ({self.machine_rank}) must be below launch.num_machines ({self.num_machines})"
            )
        return self
