"""Distillation helpers behind :mod:`featstore.kd`: one teacher's rows, ensembles of teachers (pure torch)."""

from featstore.distill._ensemble import Ensemble, Member, ensemble, most_confident
from featstore.distill._fused import FusedKD
from featstore.distill._teachers import (TeacherRows, check_rule, check_temperature, kl_rows, output_form, read_rows,
                                         real_rows, reverse_kl_rows, row_mean, sparse_parts)

__all__ = ["Ensemble", "FusedKD", "Member", "TeacherRows", "check_rule", "check_temperature", "ensemble", "kl_rows",
           "most_confident", "output_form", "read_rows", "real_rows", "reverse_kl_rows", "row_mean", "sparse_parts"]
