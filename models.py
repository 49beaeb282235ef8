"""Loading a policy: (model, tokenizer) from a Hugging Face folder or hub id, on one device or
sharded across ranks (FSDP2) so that no rank ever holds the whole model.

Used by train.py (the policy and its reference), evaluate.py and analysis.py. The tokenizer is
loaded first and checked (transformers-5's tokenizer pitfall, method.md §9); attention is
flash-attn when the GPU extra is installed, else SDPA (on CPU under bf16 autocast: SDPA computed
in float32, `_sdpa_float32`).
"""

import json
import os

import torch

from plumbing import errors

# ----------------------------------------------------------------------------------------------
# Attention implementations


def _default_attn_implementation(dtype) -> str:
    # flash-attn is an optional GPU extra (requirements-gpu.txt); it does not build on CPU boxes,
    # and it computes only in bf16/fp16: float32 weights (--dtype float32) get SDPA. (Float32 master
    # weights under bf16 autocast are fine: autocast hands flash-attn bf16 q/k/v.)
    mixed = dtype == torch.float32 and torch.is_autocast_enabled("cuda")
    if torch.cuda.is_available() and (dtype in (torch.bfloat16, torch.float16) or mixed):
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except Exception:
            pass
    return "sdpa"


def _sdpa_float32(module, query, key, value, attention_mask, **kw):
    """transformers' SDPA attention computed in float32 even under bf16 autocast. On this CPU
    (AVX512-BF16) torch's fused attention is slow in bf16, its backward most: forward + backward of
    a 64 x 150-token micro-batch of the tiny model took 0.66 s with bf16 SDPA, 0.40 s with this,
    0.61 s all in float32, while the projections around it gain from bf16. Float32 SDPA also keeps
    the fused kernel's memory (no L x L probabilities saved, as eager attention would)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with torch.autocast(query.device.type, enabled=False):
        out, w = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                        **kw)
    return out.to(query.dtype), w


def _register_attention():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("sdpa_float32", _sdpa_float32)
    AttentionMaskInterface.register("sdpa_float32", sdpa_mask)  # else padding would not be masked


_register_attention()


def load_tokenizer(path):
    """The tokenizer of a model folder or hub id, with a pad token and left padding (see
    load_policy), or OSError / ValueError with a message naming the folder.

    transformers 5.x: AutoTokenizer in a folder with a Qwen2 config.json returns Qwen2Tokenizer
    and silently replaces a custom tokenizer's normalizer/pre-tokenizer (method.md §9). A tokenizer
    saved as a plain PreTrainedTokenizerFast is therefore loaded as exactly that; anything else
    (e.g. Qwen2.5-Math's own Qwen2Tokenizer) goes through AutoTokenizer. In a folder without any
    tokenizer file AutoTokenizer builds an empty one (every prompt encodes to no tokens) instead of
    failing: such a folder is refused here."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # What a saved tokenizer is made of: the fast one's file, or a slow one's vocabulary.
    vocab_files = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, f)) for f in vocab_files):
        raise OSError(f"{path} holds no tokenizer (none of {', '.join(vocab_files)}): copy the "
                      "tokenizer files of the model it was trained from into it")
    tok_json = os.path.join(str(path), "tokenizer.json")
    cfg_json = os.path.join(str(path), "tokenizer_config.json")
    try:
        cls = None
        if os.path.isfile(tok_json) and os.path.isfile(cfg_json):
            with open(cfg_json) as f:
                cls = json.load(f).get("tokenizer_class")
        # transformers 5.x saves a PreTrainedTokenizerFast (an alias) as "TokenizersBackend".
        if cls in ("PreTrainedTokenizerFast", "TokenizersBackend"):
            tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
        else:
            tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError:
        raise                           # transformers' own message (no such folder or hub id)
    except Exception as e:              # a truncated tokenizer.json: JSON's or the tokenizers library's error
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise ValueError(f"cannot read the tokenizer in {path}: {why}") from e
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer in {path} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_policy(path, *, device="cpu", dtype=None, attn_implementation=None, shard=None):
    """Load (model, tokenizer) from a HF folder (or hub id on machines that have the hub).

    device: a torch device, or "auto" (CUDA when available).
    dtype: bfloat16 on CUDA devices, float32 otherwise, unless given ("auto" = not given).
    attn_implementation: "flash_attention_2" when CUDA is available and flash_attn imports, else
    "sdpa", unless given. The tokenizer (load_tokenizer) gets a pad token (eos if missing) and
    left padding, which is what batched decoding needs; it is loaded first, so a folder without
    one fails in a second, not after the weights are read.
    shard: a function that shards a model in place (FSDP2's fully_shard, distributed.wrap_model);
    then the model is built on the meta device, sharded, and each rank reads only its shard of each
    tensor from the safetensors files: no rank ever holds the whole model.
    Bad folders raise OSError or ValueError (train.py and evaluate.py turn them into one line).
    """
    from transformers import AutoModelForCausalLM

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if dtype == "auto":
        dtype = None
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if attn_implementation is None:
        attn_implementation = _default_attn_implementation(dtype) if device.type == "cuda" else "sdpa"
    tokenizer = load_tokenizer(path)
    if shard is not None:
        model = _load_sharded(path, device, dtype, attn_implementation, shard)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                     attn_implementation=attn_implementation).to(device)
    return model, tokenizer


def _load_sharded(path, device, dtype, attn_implementation, shard):
    """Meta-device model -> shard() -> materialise each rank's shards -> fill them tensor by tensor
    from the (memory-mapped) safetensors files, each rank keeping only its slice."""
    import glob

    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, distribute_tensor
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if not os.path.isdir(path):  # a hub id, on machines that have the hub
        from huggingface_hub import snapshot_download
        path = snapshot_download(path, allow_patterns=["*.json", "*.safetensors"])
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    model = shard(model)
    model.to_empty(device=device)
    for parent in list(model.modules()):  # non-persistent buffers (RoPE inv_freq) were never materialised
        for name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RotaryEmbedding"):
                setattr(parent, name, type(child)(config=child.config).to(device))
    params = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in model.named_parameters()}
    with torch.no_grad():
        for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    p = params.get(name)  # (absent: e.g. the lm_head of a tied model)
                    if p is None:
                        continue
                    full = f.get_tensor(name).to(device=device, dtype=p.dtype)
                    if isinstance(p, DTensor):  # every rank has the file: no communication
                        full = distribute_tensor(full, p.device_mesh, p.placements,
                                                 src_data_rank=None).to_local()
                        p = p.to_local()
                    p.copy_(full)
    try:
        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        pass
    return model


TINY_WORLD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tinymath")


def load_for_training(path, device, dtype, shard=None, bf16=False):
    """load_policy for train.py: a missing local folder or one that does not load (a truncated
    model.safetensors too) is one line (`error: ...`, exit), not a traceback; under bf16 autocast
    on a CPU attention is SDPA in float32 (why: _sdpa_float32)."""
    if (os.path.isabs(path) or path.startswith(".")) and not os.path.exists(path):   # not a hub id either
        hint = " (the tiny world's: python -m data.tinymath.prepare)" if path.startswith(TINY_WORLD) else ""
        raise SystemExit(f"error: model folder {path} not found{hint}")
    from safetensors import SafetensorError

    attn = "sdpa_float32" if bf16 and torch.device(device).type == "cpu" else None
    # no folder, no usable config, a truncated weights file (as evaluate.py's heldout.load_model says)
    with errors.one_line((OSError, ValueError, SafetensorError), f"cannot load model {path!r}"):
        return load_policy(path, device=device, dtype=dtype, shard=shard, attn_implementation=attn)
