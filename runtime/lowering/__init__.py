"""Lowering: a model and a Program to the Plan of every rank (IR, scheduler, deadlock dry
run, rank mesh), without torch.distributed or Ray; the planner and the simulator use it as is.
May import piper, search_spaces and runtime.train (a weights folder's check)."""
