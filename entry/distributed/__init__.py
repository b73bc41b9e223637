"""Ranks: the process group's life cycle, sharding (FSDP2/DDP), the precision recipe, fault
injection for the tests, and the simulated memory plan of N ranks."""
