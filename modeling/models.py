"""Loading a policy: (model, tokenizer) from a Hugging Face folder or hub id, on one device or
sharded across ranks (FSDP2) so that no rank ever holds the whole model.

Used by train.py (the policy and its reference), evaluate.py and analysis.py. The tokenizer is
loaded first and checked (transformers-5's tokenizer pitfall, method.md §9); attention follows the
run's compute dtype (`attention_for`): flash-attn for bf16 on CUDA when the GPU extra is installed,
else SDPA on a mask where padding rows attend to themselves (on CPU under bf16 autocast, SDPA
computed in float32, `_sdpa_float32`).
"""

import functools
import inspect
import json
import os
from dataclasses import dataclass

import torch

from plumbing import errors

# ----------------------------------------------------------------------------------------------
# Attention implementations: chosen by the run's compute dtype, the same for policy and reference

SDPA = "sdpa_padsafe"          # torch's SDPA on a mask where every query row has a key (_padsafe_sdpa_mask)
SDPA_FLOAT32 = "sdpa_float32"  # the same computed in float32 (CPU under bf16 autocast: _sdpa_float32)
FLASH = "flash_attention_2"    # flash-attn (the optional GPU extra, requirements-gpu.txt)


@dataclass(frozen=True)
class Attention:
    implementation: str        # from_pretrained's attn_implementation
    description: str           # one line for the start of a run


def attention_for(device, dtype, bf16=False) -> Attention:
    """The attention of a run computing in bf16 (`bf16`: float32 weights under bf16 autocast, or
    FSDP2's bf16 parameters) or in the weights' `dtype`, on `device`. train.py passes the same
    arguments for the policy and for its bf16 reference, so both get the same kernel: a policy
    on SDPA beside a reference on flash-attn would put a kernel mismatch under Policy-KL at step 0.
    flash-attn computes only in bf16/fp16 and does not build on CPU boxes."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    compute = str(torch.bfloat16 if bf16 else dtype).removeprefix("torch.")
    if device.type == "cpu":
        if bf16:
            return Attention(SDPA_FLOAT32, f"{ATTENTION} SDPA computed in float32 under bf16 autocast "
                                           f"(faster on a CPU), {PAD_ROWS}")
        return Attention(SDPA, f"{ATTENTION} SDPA, {PAD_ROWS}")
    if compute not in ("bfloat16", "float16"):
        return Attention(SDPA, f"{ATTENTION} SDPA, {PAD_ROWS} ({compute} compute: flash-attn is bf16/fp16)")
    try:
        import flash_attn  # noqa: F401
    except Exception:              # not installed, or built against another torch/CUDA
        return Attention(SDPA, f"{ATTENTION} SDPA, {PAD_ROWS} (flash_attn not installed: {REQUIREMENTS_GPU})")
    return Attention(FLASH, f"{ATTENTION} flash-attn 2, {compute} compute on {device.type}")


ATTENTION = "attention (policy and reference):"
PAD_ROWS = "padding rows attend to themselves"
REQUIREMENTS_GPU = "pip install -r requirements-gpu.txt --no-build-isolation"


def no_empty_rows(mask, q_pos, kv_pos):
    """(B, 1, Q, K) boolean mask -> the same, where a query row with no key to attend to (a left
    pad: causal attention lets it see only pads) attends to the key at its own position. SDPA's
    softmax over an empty row is 0/0: some GPU kernels return NaN there (transformers 5.x no longer
    patches it), the pad's state goes NaN, and the next layer's values multiply NaN by a 0 weight
    in every real row. Its own key is always written and finite; real rows are left as they were.
    q_pos (Q,), kv_pos (K,): the positions of the queries and keys."""
    alone = ~mask.any(-1, keepdim=True)                                 # (B, 1, Q, 1)
    own = q_pos.to(mask.device)[:, None] == kv_pos.to(mask.device)[None, :]   # (Q, K)
    return mask | (alone & own)


@functools.cache
def _signature(fn):
    return inspect.signature(fn)


def _padsafe_sdpa_mask(*args, **kwargs):
    """transformers' sdpa_mask, then no_empty_rows. None (SDPA's is_causal: no padding) passes."""
    from transformers.masking_utils import sdpa_mask

    mask = sdpa_mask(*args, **kwargs)
    if not (torch.is_tensor(mask) and mask.dtype == torch.bool):
        return mask
    bound = _signature(sdpa_mask).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    dev = mask.device
    if a.get("cache_position") is not None:                           # (older transformers' signature)
        q_pos = a["cache_position"]
    else:
        q_pos = torch.arange(a["q_length"], device=dev) + a.get("q_offset", 0)
    kv_pos = torch.arange(a["kv_length"], device=dev) + a.get("kv_offset", 0)
    return no_empty_rows(mask, q_pos, kv_pos)


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
    """Both SDPA names get the pad-safe mask: every forward through a model this module loads (the
    training forwards, the reference, the query cache, the sampler's prefill) hands SDPA a mask
    with a key in every row."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(SDPA, sdpa_attention_forward)
    AttentionInterface.register(SDPA_FLOAT32, _sdpa_float32)
    for name in (SDPA, SDPA_FLOAT32):
        AttentionMaskInterface.register(name, _padsafe_sdpa_mask)   # (unregistered: no padding mask at all)


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
    attn_implementation: attention_for(device, dtype) (flash-attn for bf16/fp16 weights on CUDA when
    flash_attn imports, else pad-safe SDPA), unless given. The tokenizer (load_tokenizer) gets a
    pad token (eos if missing) and left padding, which is what batched decoding needs; it is
    loaded first, so a folder without one fails in a second, not after the weights are read.
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
        attn_implementation = attention_for(device, dtype).implementation
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


TINY_WORLD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "tinymath")


def load_for_training(path, device, dtype, shard=None, bf16=False, attention: Attention | None = None):
    """load_policy for train.py: a missing local folder or one that does not load (a truncated
    model.safetensors too) is one line (`error: ...`, exit), not a traceback. Attention:
    `attention`, else attention_for(device, dtype, bf16): the run's compute dtype, not autocast's
    state at load time (train.py loads outside autocast)."""
    if (os.path.isabs(path) or path.startswith(".")) and not os.path.exists(path):   # not a hub id either
        hint = " (the tiny world's: python -m data.tinymath.prepare)" if path.startswith(TINY_WORLD) else ""
        raise SystemExit(f"error: model folder {path} not found{hint}")
    from safetensors import SafetensorError

    attn = (attention or attention_for(device, dtype, bf16)).implementation
    # no folder, no usable config, a truncated weights file (as evaluate.py's heldout.load_model says)
    with errors.one_line((OSError, ValueError, SafetensorError), f"cannot load model {path!r}"):
        return load_policy(path, device=device, dtype=dtype, shard=shard, attn_implementation=attn)
