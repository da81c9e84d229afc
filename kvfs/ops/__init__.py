"""kvfs.ops: what operators set and watch: profiles (``profiles/*.json``, the only place
their values live), alert rules, and the process's Prometheus registry."""
