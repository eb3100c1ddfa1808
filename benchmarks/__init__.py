"""featstore's benchmark: featstore side by side with the classic approaches and with LitData and
Mosaic Streaming, on one workload, in one run (``python -m benchmarks --profile quick``).

Every comparison is a ratio of figures measured in the same run on the same data: the machine is
shared and noisy, so absolute times mean little. Nothing here is imported by ``featstore``.
"""
