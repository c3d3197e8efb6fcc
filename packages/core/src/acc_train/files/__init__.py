"""Files acc-train reads and writes: output directories made without harm, disk-full handling, user files, YAML."""
