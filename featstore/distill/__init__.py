"""Distillation helpers behind :mod:`featstore.kd`: one teacher's rows, ensembles of teachers (pure torch)."""
