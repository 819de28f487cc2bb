"""Train a NextN head (DeepSeek's multi-token-prediction layer) for a Llama-architecture model on
its own greedy generations, and save it as a head folder that dayzero drafts with:

    dayzero serve MODEL --speculative-config '{"method": "mtp", "model": "OUT", "num_speculative_tokens": 3}'

    python scripts/train_nextn.py OUT [--model PATH] [--prompts 960] [--new-tokens 256] [--epochs 8]

The head (sdk/config/model.py MtpCfg), at each position i of a sequence t with the model's final
normed hidden states z:
    x_0 = W_eh [rmsnorm_e(emb(t_{i+1})) ; rmsnorm_h(z_i)],  y = layer(x_0) (causal over i),
    logits_i = lm_head(rmsnorm_s(y_i))  ~  t_{i+2}
with the model's own embedding and LM head (frozen) and one decoder layer of the model's shape.

1. dayzero generates greedy answers to seeded chat prompts (topic x task templates; the topics of
   tests/test_mtp_head.py's acceptance gate are not among them);
2. transformers (the parity reference) gives z over each whole sequence;
3. the head trains in transformers' own modules (LlamaDecoderLayer, LlamaRMSNorm; the layer starts
   as a copy of the model's last) on the answers' positions, cross-entropy against the greedy
   tokens, AdamW with a cosine schedule;
4. the head is saved under the names a checkpoint with the layer would use (model.layers.{L}.*,
   bf16) with config.json {num_nextn_predict_layers: 1, the model's shape}; then dayzero decodes
   held-out prompts with it (3 drafts) and prints the mean acceptance length.
Runs on a GPU when one is visible (`--device`; the shipped head's run is in its training.json: its
generation took 6 s and its training 26 s on an H100), else on the CPU (the earlier 640-prompt,
160-token, 6-epoch head took about 35 minutes on 2 cores); progress is printed at every stage.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from dayzero.sdk.api import LLM, embedded_default
from dayzero.sdk.bench.decode import BENCH_TOPICS as HELD_OUT  # the gate's and the bench's topics
from dayzero.sdk.engine.drafters import SpeculativeConfig
from dayzero.sdk.engine.engine import SamplingParams
from dayzero.sdk.loader.tokenizer import chat_ids

# fmt: off
TOPICS = [
    "the ocean", "volcanoes", "honey bees", "the moon landing", "chess", "coffee", "rainforests",
    "the printing press", "electric cars", "dinosaurs", "the human heart", "jazz music", "glaciers",
    "ancient Rome", "photosynthesis", "the internet", "mountains", "bread baking", "owls",
    "the solar system", "recycling", "the Olympic games", "robots", "deserts", "friendship",
    "earthquakes", "the violin", "vaccines", "trains", "gardening", "lighthouses", "penguins",
    "the Renaissance", "black holes", "cheese", "bicycles", "rivers", "libraries", "tea", "hurricanes",
    "the Great Wall of China", "sleep", "octopuses", "windmills", "museums", "elephants",
    "the stock market", "rainbows", "submarines", "the Amazon river", "chocolate", "solar panels",
    "whales", "the brain", "castles", "airplanes", "football", "climate change", "mushrooms",
    "the Eiffel Tower", "dogs", "cats", "space stations", "painting", "bridges", "wolves", "the Moon",
    "rice", "clocks", "forests", "the Roman Colosseum", "snakes", "music", "batteries", "islands",
    "writing a novel", "yoga", "birds", "the alphabet", "cooking pasta",
]
TASKS = [
    "Write a short story about {}.", "Explain {} to a ten-year-old.", "List five facts about {}.",
    "Write a short poem about {}.", "What are the pros and cons of {}?", "Give me three tips about {}.",
    "Describe the history of {} in a paragraph.", "Write a friendly email to a colleague about {}.",
    "Tell me about {}.", "What is interesting about {}?", "Why does {} matter?",
    "How would you teach {}?",
]
# fmt: on
assert not set(HELD_OUT) & set(TOPICS)


def generate(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], int]]:
    """(prompt + greedy answer, the prompt's length) for each prompt, in batches of 64."""
    out, greedy = [], SamplingParams(max_tokens=new_tokens, temperature=0)
    t0 = time.perf_counter()
    for i in range(0, len(prompts), 64):
        batch = prompts[i : i + 64]
        done = llm.generate([{"prompt_token_ids": p} for p in batch], greedy)
        out += [(p + list(c.outputs[0].token_ids), len(p)) for p, c in zip(batch, done, strict=True)]
        n = sum(len(s) - m for s, m in out)
        print(f"  generated {len(out)}/{len(prompts)} answers, {n} tokens, {time.perf_counter() - t0:.0f} s")
    return out


class NextNHead(nn.Module):
    """The head being trained (the module docstring's formula), in transformers' modules."""

    def __init__(self, base) -> None:
        super().__init__()
        cfg, d = base.config, base.config.hidden_size
        self.enorm, self.hnorm = LlamaRMSNorm(d, cfg.rms_norm_eps), LlamaRMSNorm(d, cfg.rms_norm_eps)
        self.norm = LlamaRMSNorm(d, cfg.rms_norm_eps)
        self.norm.load_state_dict(base.model.norm.state_dict())
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        with torch.no_grad():  # start as the mean of the two normed inputs
            self.eh_proj.weight.copy_(torch.cat((torch.eye(d), torch.eye(d)), 1) / 2)
        self.layer = LlamaDecoderLayer(cfg, cfg.num_hidden_layers)
        self.layer.load_state_dict(base.model.layers[-1].state_dict())
        self.rotary = LlamaRotaryEmbedding(cfg)

    def forward(self, emb: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """emb [B, M, D] (of t_{i+1}), z [B, M, D] -> rmsnorm_s(y) [B, M, D]"""
        x = self.eh_proj(torch.cat((self.enorm(emb), self.hnorm(z)), -1))
        m = x.shape[1]
        pos = torch.arange(m, device=x.device)[None].expand(x.shape[0], m)
        mask = torch.full((m, m), torch.finfo(x.dtype).min, device=x.device).triu(1)[None, None]
        y = self.layer(x, attention_mask=mask, position_ids=pos, position_embeddings=self.rotary(x, pos))
        return self.norm(y[0] if isinstance(y, tuple) else y)


def save(head: NextNHead, base, out: Path, info: dict) -> None:
    cfg, n = base.config, base.config.num_hidden_layers
    p = f"model.layers.{n}."
    tensors = {
        p + "enorm.weight": head.enorm.weight,
        p + "hnorm.weight": head.hnorm.weight,
        p + "eh_proj.weight": head.eh_proj.weight,
        p + "shared_head.norm.weight": head.norm.weight,
    } | {p + k: v for k, v in head.layer.state_dict().items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().to(torch.bfloat16).contiguous() for k, v in tensors.items()},
        out / "model.safetensors",
        metadata={"format": "pt"},
    )
    shape = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "vocab_size")  # fmt: skip
    config = {"num_nextn_predict_layers": 1} | {k: getattr(cfg, k) for k in shape}
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "training.json").write_text(json.dumps(info, indent=1) + "\n")


def torch_device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def acceptance(
    model: str | None, head: Path, prompts: list[list[int]], new_tokens: int, device: str, k: int = 3
) -> float:
    """Mean accepted tokens a verify step (1 + accepted drafts) of dayzero's greedy decode."""
    spec = SpeculativeConfig("mtp", k, model=str(head))
    llm = LLM(model, device=device, speculative_config=spec)
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=new_tokens, temperature=0)
    )
    st = llm.engine.stats
    return 1 + sum(st["accepted_at"]) / max(1, st["verify_rows"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument(
        "--model", default=None, help="a Llama-architecture checkpoint (default: the embedded one)"
    )
    ap.add_argument("--prompts", type=int, default=960)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=8, help="sequences a step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    dev = torch.device(a.device)
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    path = Path(a.model) if a.model else embedded_default()

    print(f"[1/4] greedy answers to {a.prompts} prompts from {path}")
    llm = LLM(str(path), device=a.device)
    pairs = [(t, topic) for t in TASKS for topic in TOPICS]
    rng.shuffle(pairs)
    texts = [task.format(topic) for task, topic in pairs[: a.prompts]]
    tok = llm.tokenizer
    data = generate(llm, [chat_ids(tok, t) for t in texts], a.new_tokens)
    del llm

    print("[2/4] the model's final hidden states (transformers)")
    kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    base = AutoModelForCausalLM.from_pretrained(path.parent if kw else path, dtype=torch.float32, **kw)
    base = base.to(dev).eval()
    for p in base.parameters():
        p.requires_grad_(False)
    seqs = []
    with torch.no_grad():
        for j, (ids, m) in enumerate(data):
            t = torch.tensor(ids, device=dev)
            z = base.model(input_ids=t[None]).last_hidden_state[0]  # [L, D]
            seqs.append((t, z, m))
            if (j + 1) % 64 == 0:
                print(f"  {j + 1}/{len(data)} sequences")
    held = seqs[: max(1, len(seqs) // 16)]  # validation sequences
    train = seqs[len(held) :]

    print(f"[3/4] training on {sum(len(t) - m for t, _, m in train)} answer tokens, {a.epochs} epochs")
    head = NextNHead(base).to(dev)
    params = [p for n, p in head.named_parameters() if not n.startswith("rotary")]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)
    steps = a.epochs * math.ceil(len(train) / a.batch)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    embed, lm_head = base.model.embed_tokens, base.lm_head

    def loss_acc(batch) -> tuple[torch.Tensor, int, int]:
        total, hits, count = 0.0, 0, 0
        for t, z, m in batch:  # position i: inputs (z_i, t_{i+1}), target t_{i+2}
            s = head(embed(t[1:-1])[None], z[None, :-2])[0]
            tgt, first = t[2:], max(0, m - 2)  # targets from the answer's first token on
            logits = lm_head(s[first:])
            total = total + nn.functional.cross_entropy(logits, tgt[first:], reduction="sum")
            hits += int((logits.argmax(-1) == tgt[first:]).sum())
            count += len(tgt) - first
        return total / max(1, count), hits, count

    t0 = time.perf_counter()
    for ep in range(a.epochs):
        rng.shuffle(train)
        for i in range(0, len(train), a.batch):
            loss, hits, count = loss_acc(train[i : i + a.batch])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            if (i // a.batch) % 8 == 0:
                print(f"  epoch {ep + 1} batch {i // a.batch}: loss {loss.item():.3f} "
                      f"top-1 {hits / max(1, count):.3f} ({time.perf_counter() - t0:.0f} s)")  # fmt: skip
        with torch.no_grad():
            vloss, vhits, vcount = loss_acc(held)
        print(f"  epoch {ep + 1}: held-out loss {vloss.item():.3f}, top-1 {vhits / vcount:.3f}")

    print(f"[4/4] saving the head to {a.out}; acceptance on held-out prompts")
    info = {
        "model": path.name, "prompts": a.prompts, "new_tokens": a.new_tokens, "epochs": a.epochs,
        "lr": a.lr, "batch": a.batch, "seed": a.seed, "device": torch_device_name(dev),
        "train_seconds": round(time.perf_counter() - t0),
        "held_out_top1": round(vhits / vcount, 4), "held_out_loss": round(vloss.item(), 4),
    }  # fmt: skip
    save(head, base, a.out, info)
    prompts = [chat_ids(tok, f"Tell me about {x}.") for x in HELD_OUT[:4]]
    acc = acceptance(str(path) if a.model else None, a.out, prompts, 64, a.device)
    info["acceptance_length_k3"] = round(acc, 3)
    (a.out / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"mean acceptance length (3 drafts, greedy, 4 held-out prompts x 64 tokens): {acc:.3f}")


if __name__ == "__main__":
    main()
