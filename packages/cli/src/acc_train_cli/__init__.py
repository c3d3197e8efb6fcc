"""The ``acc-train`` command."""
