"""onnxruntime-genai's side of tools/compare/race.py, run in genai's own environment (it
ships its own onnxruntime, which must not meet edgespec's): loads one model once, then
answers one JSON request per stdin line with one JSON line on stdout.

    request:  {"ids": [token ids], "max_new_tokens": 128}
    answer:   {"ids": [generated ids], "first_s": prefill + first token, "decode_s": the rest}

Greedy only; decode speed is (len(ids) - 1) / decode_s, edgespec's definition.
"""

from __future__ import annotations

import json
import sys
import time

import onnxruntime_genai as og

WINDOW_ROOM = 1024  # the widest sliding window of the models raced (Gemma 3: 512)


def generate(model: og.Model, ids: list[int], max_new_tokens: int) -> dict:
    params = og.GeneratorParams(model)
    # a sliding-window model (Gemma 3) refuses a KV cache shorter than its window
    params.set_search_options(max_length=max(len(ids) + max_new_tokens, WINDOW_ROOM),
                              do_sample=False)
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(ids)
    out: list[int] = []
    first = 0.0
    while not generator.is_done() and len(out) < max_new_tokens:
        generator.generate_next_token()
        out.append(int(generator.get_next_tokens()[0]))
        if len(out) == 1:
            first = time.perf_counter()
    end = time.perf_counter()
    return {"ids": out, "first_s": first - start, "decode_s": end - first}


def main() -> None:
    model = og.Model(sys.argv[1])
    print(json.dumps({"ready": og.__version__}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        print(json.dumps(generate(model, request["ids"], request["max_new_tokens"])),
              flush=True)


if __name__ == "__main__":
    main()
