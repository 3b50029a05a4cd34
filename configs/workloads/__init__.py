"""Built-in workload definitions (TOML files)."""
