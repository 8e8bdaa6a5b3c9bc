"""QLLM Pipeline: one module per stage (`python -m pipelines.<stage>`), see README.md."""

import logging

# bitsandbytes (imported by PEFT whenever it is installed) tries, on AVX512-BF16 CPUs, to fetch an
# optional inference kernel from the Hugging Face hub with the `kernels` package, and warns on
# every import when it cannot. The kernel only serves bitsandbytes' repacked CPU inference layout,
# which QLoRA here keeps off (`pipelines.core.quantize.keep_standard_layout`): the warning is noise.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
