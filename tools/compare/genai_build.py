"""onnxruntime-genai 0.18's model builder, run in genai's own environment, with one fix:
transformers 5 gives Gemma 3 one RoPE table per attention type
(`rope_parameters = {"full_attention": {...}, "sliding_attention": {...}}`), which the
builder reads as one flat table and fails on (KeyError: 'rope_type'); its Gemma 3 class
wants the global table flat and the sliding one's theta as `rope_local_base_freq`, as
transformers 4 gave them. Everything else is the builder's own command line.

    python genai_build.py -i HF_DIR -o OUT -p int4 -e cpu -c CACHE
"""

import runpy
import sys

import transformers


def _flat_rope(config):
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "full_attention" in rope:
        config.rope_local_base_freq = rope.get("sliding_attention", {}).get("rope_theta")
        config.rope_parameters = dict(rope["full_attention"])
    for sub in ("text_config",):
        if hasattr(config, sub):
            _flat_rope(getattr(config, sub))
    return config


_load = transformers.AutoConfig.from_pretrained
transformers.AutoConfig.from_pretrained = lambda *a, **k: _flat_rope(_load(*a, **k))
sys.argv[0] = "onnxruntime_genai.models.builder"
runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)
