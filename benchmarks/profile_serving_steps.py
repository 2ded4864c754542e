"""The engine's step timeline under a closed-loop load like `vllm bench serve --max-concurrency C` (fixed prompt and
output lengths, random token ids, a new request as soon as one finishes), run in-process without HTTP: each step's
wall time, its prefilling and decoding sequences, the Triton compilations and garbage collections it met.

    python -m benchmarks.profile_serving_steps [model] [concurrency] [num_requests] [input_len] [output_len] [freeze|nofreeze]

(defaults llama3_8b 64 256 1024 256, `tiny` for a 2-layer Llama; dummy weights; the server's token budget). Prints the slowest steps, a histogram
of step times by kind, and every Triton compile with the step it happened in."""

import gc
import sys
import time
import collections
import yaml
import torch
from cvllm_lab import LLM
from cvllm_lab.sampling_params import SamplingParams
from cvllm_lab.bench.sweep import model_dir
from cvllm_lab.engine.core_proc import freeze_gc_heap

# `tiny`: a 2-layer Llama whose steps cost little, so that host-side (scheduler, KV manager) stalls stand out on a CPU
TINY = dict(
    name='tiny-llama-serving',
    hf_config=dict(
        architectures=['LlamaForCausalLM'],
        model_type='llama',
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=8192,
    ),
)
compiles = []


def hook_triton():
    "Log every Triton compile (kernel name, seconds): wraps the compiler entry the JIT calls."
    import triton.runtime.jit as jit
    import triton.compiler as tc

    orig = tc.compile

    def logged(src, *a, **k):
        t = time.perf_counter()
        out = orig(src, *a, **k)
        compiles.append((getattr(getattr(src, 'fn', None), '__name__', str(src)[:40]), time.perf_counter() - t))
        return out

    tc.compile = logged
    if hasattr(jit, 'compile'):
        jit.compile = logged


gc_pauses = []  # (generation, seconds) of every collection during the measured run


def hook_gc():
    t0 = [0.0]

    def cb(phase, info):
        if phase == 'start':
            t0[0] = time.perf_counter()
        else:
            gc_pauses.append((info['generation'], time.perf_counter() - t0[0]))

    gc.callbacks.append(cb)


def main(model='llama3_8b', C=64, N=256, P=1024, O=256, freeze='freeze'):
    C, N, P, O = int(C), int(N), int(P), int(O)
    hook_triton()
    hook_gc()
    spec = TINY if model == 'tiny' else yaml.safe_load(open(f'conf/model/{model}.yaml'))
    llm = LLM(
        str(model_dir(spec)),
        load_format='dummy',
        skip_tokenizer_init=True,
        progress=False,
        max_model_len=max(2048, P + O),
        gpu_memory_utilization=0.85,
        usage_context='server',
        **({} if torch.cuda.is_available() else {'kv_cache_memory': 256 << 20}),
    )
    eng, g = llm.engine, torch.Generator().manual_seed(1)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sp = SamplingParams(temperature=0, max_tokens=O, ignore_eos=True, detokenize=False)
    new = lambda: eng.add_request(
        None, {'prompt_token_ids': torch.randint(100, eng.vocab_size, (P,), generator=g).tolist()}, sp
    )
    sp.max_tokens = 16
    for _ in range(2):  # warm-up rounds on other prompts, as the server benchmark does
        for _ in range(C):
            new()
        while eng.has_unfinished_requests():
            eng.step()  # the front end forgets finished requests
    sp.max_tokens = O
    if freeze == 'freeze':
        freeze_gc_heap()  # as the engine-core process does once started
    compiles.clear()
    gc_pauses.clear()
    live, sent, steps = set(), 0, []
    while sent < C:
        live.add(new())
        sent += 1
    t_start = time.perf_counter()
    while live:
        n_c, n_g = len(compiles), len(gc_pauses)
        sync()
        t = time.perf_counter()
        outs = eng.step()
        sync()
        dt = time.perf_counter() - t
        sched = eng.core.last_scheduled or []
        pre = sum(1 for r in sched if r.num_output_tokens <= 1)  # prefilling, or its first token just made
        steps.append(
            dict(
                t=t - t_start,
                ms=1e3 * dt,
                seqs=len(sched),
                prefills=pre,
                compiles=compiles[n_c:],
                gc_ms=sum(1e3 * d for _, d in gc_pauses[n_g:]),
                gc2=sum(g == 2 for g, _ in gc_pauses[n_g:]),
            )
        )
        for i in [o.request_id for o in outs if o.finished]:
            live.discard(i)
            if sent < N:
                live.add(new())
                sent += 1
    total = time.perf_counter() - t_start
    print(f'{model} C={C} N={N} {P}->{O}: {len(steps)} steps in {total:.2f} s, {N * O / total:.0f} output tok/s')
    kinds = collections.defaultdict(list)
    for s in steps:
        kinds['mixed' if s['prefills'] else 'decode'].append(s['ms'])
    for k, v in kinds.items():
        v = sorted(v)
        print(
            f'{k:7s} steps {len(v):5d}  p50 {v[len(v) // 2]:7.1f} ms  p90 {v[int(len(v) * 0.9)]:7.1f}  max {v[-1]:7.1f}'
        )
    print('slowest steps:')
    for s in sorted(steps, key=lambda s: -s['ms'])[:15]:
        print(
            f'  t={s["t"]:7.3f}s {s["ms"]:7.1f} ms seqs {s["seqs"]:3d} prefills {s["prefills"]:3d} '
            f'gc {s["gc_ms"]:6.1f} ms ({s["gc2"]} full) compiles {s["compiles"]}'
        )
    print(f'Triton compiles during the measured run: {sum(len(s["compiles"]) for s in steps)}')
    full = [d for g, d in gc_pauses if g == 2]
    print(
        f'garbage collections: {len(gc_pauses)}, {sum(d for _, d in gc_pauses):.3f} s; full ones: {len(full)}, '
        f'longest {1e3 * max(full, default=0):.1f} ms (heap {"frozen" if freeze == "freeze" else "not frozen"})'
    )


if __name__ == '__main__':
    main(*sys.argv[1:])
