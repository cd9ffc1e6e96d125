"""How sharp a draft head's sampling proposals should be: its `proposal_scale`.

Sampling, a head token drawn from q is accepted with probability sum_x min(p(x), q(x)),
and any q keeps the output the target's; a head that learnt the target's distribution
only beside its next state proposes best from a softmax sharper than the target's. This
measures that sum, teacher-forced, for q = the head's softmax at several multiples of the
target's temperature: the float model (transformers' own GGUF loading) answers held-out
bench prompts sampling at that temperature (on greedy answers, where the target is surer
of itself, sharper proposals look better than they are: SmolLM2's head scored best at
scale 0.6 and Gemma 3's at 0.2 there, and neither gained in decoding), and along each
answer the head reads its final-norm states.

    python tools/eval_proposal_scale.py MODEL.gguf HEAD.npz --temperature 0.7 1.0 \\
        [--scales 0.4 0.5 0.6 0.7 0.8 1.0] [--limit 14] [--new 128]

Put the best scale in the head's card ("proposal_scale"); an export copies it into the
bundle's manifest, and spec.drafters.HeadDrafter proposes with it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from edgespec.bench_sets import load_set, plain_text, select
from edgespec.export.draft_head import load_head
from edgespec.train.model import EagleHead
from edgespec.train.trainer import batch_of


def answers(model, tok, prompts: list[dict], new: int, temperature: float
            ) -> list[tuple[list[int], int]]:
    """(prompt + answer ids, prompt length) per prompt, one batch, left-padded."""
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    texts = [tok.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True)
             if tok.chat_template else plain_text(p["messages"]) for p in prompts]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=not tok.chat_template)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=new, do_sample=True, temperature=temperature,
                             top_k=0, top_p=1.0)
    seqs = []
    for row, mask in zip(out.tolist(), enc["attention_mask"], strict=True):
        n = int(mask.sum())
        row = row[enc["input_ids"].shape[1] - n:]  # without the left padding
        answer = row[n:]
        if tok.eos_token_id in answer:
            answer = answer[:answer.index(tok.eos_token_id) + 1]
        seqs.append((row[:n] + answer, n))
    return seqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="the target's .gguf file")
    ap.add_argument("head", type=Path, help="its trained head (.npz)")
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.7, 1.0])
    ap.add_argument("--scales", type=float, nargs="+", default=[0.4, 0.5, 0.6, 0.7, 0.8, 1.0])
    ap.add_argument("--limit", type=int, default=14, help="held-out prompts per category")
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model.parent, gguf_file=args.model.name,
                                                 dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(args.model.parent, gguf_file=args.model.name)
    h = load_head(args.head)
    kept = torch.from_numpy(np.asarray(h.kept))
    lm_head = model.get_output_embeddings().weight.detach()
    embed = model.get_input_embeddings()
    head = EagleHead(h.config, embed.weight.detach(), lm_head[kept],
                     float(getattr(embed, "embed_scale", 1.0)))
    head.load_weights(h.weights)
    softcap = getattr(model.config, "final_logit_softcapping", None)
    prompts = select(load_set("real"), ("chat", "code"), args.limit)
    acc = {(t, s): [] for t in args.temperature for s in args.scales}
    torch.manual_seed(0)
    with torch.no_grad():
        for t, (ids, n) in ((temp, a) for temp in args.temperature
                            for a in answers(model, tok, prompts, args.new, temp)):
            states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
            pairs, read, *_ = batch_of([(np.array(ids), states.numpy())], 1)
            q_logits = head.logits(head.unrolled(pairs, read)[0][0])  # the state after j + 1
            p_logits = states[1:] @ lm_head.T
            if softcap:
                p_logits = torch.tanh(p_logits / softcap) * softcap
            rows = [j for j in range(len(ids) - 2) if j + 2 >= n]  # drafting answer tokens
            p = torch.softmax(p_logits[rows] / t, -1)[:, kept]
            for s in args.scales:
                q = torch.softmax(q_logits[rows] / (t * s), -1)
                acc[t, s] += torch.minimum(p, q).sum(-1).tolist()
    for t in args.temperature:
        best = max(args.scales, key=lambda s: np.mean(acc[t, s]))
        scores = ", ".join(f"scale {s}: {np.mean(acc[t, s]):.4f}" for s in args.scales)
        print(f"T={t} ({len(acc[t, best])} answer positions): {scores}; best {best}")


if __name__ == "__main__":
    main()
