"""The contracts plugins implement or are handed: a data kind, wizard questions, a strategy's launch protocol, and the protocols of a job, a run and a machine."""
