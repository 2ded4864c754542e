"""The engine's step timeline under a closed-loop load like `vllm bench serve --max-concurrency C` (fixed prompt and
output lengths, random token ids, a new request as soon as one finishes), run in-process without HTTP: each step's
wall time, its prefill tokens and decoding sequences, and the Triton compilations and cuDNN-free slow steps it met.

    python -m benchmarks.profile_serving_steps [model] [concurrency] [num_requests] [input_len] [output_len]

(defaults llama3_8b 64 256 1024 256; dummy weights; the server's token budget). Prints the slowest steps, a histogram
of step times by kind, and every Triton compile with the step it happened in."""
import sys, time, collections, yaml, torch
from cvllm_lab import LLM
from cvllm_lab.sampling_params import SamplingParams
from cvllm_lab.bench.sweep import model_dir

compiles = []
def hook_triton():
    "Log every Triton compile (kernel name, seconds): wraps the compiler entry the JIT calls."
    import triton.runtime.jit as jit, triton.compiler as tc
    orig = tc.compile
    def logged(src, *a, **k):
        t = time.perf_counter(); out = orig(src, *a, **k)
        compiles.append((getattr(getattr(src, 'fn', None), '__name__', str(src)[:40]), time.perf_counter() - t)); return out
    tc.compile = logged
    if hasattr(jit, 'compile'): jit.compile = logged

def main(model='llama3_8b', C=64, N=256, P=1024, O=256):
    C, N, P, O = int(C), int(N), int(P), int(O)
    hook_triton()
    llm = LLM(str(model_dir(yaml.safe_load(open(f'conf/model/{model}.yaml')))), load_format='dummy',
              skip_tokenizer_init=True, progress=False, max_model_len=max(2048, P + O), gpu_memory_utilization=0.85,
              usage_context='server', **({} if torch.cuda.is_available() else {'kv_cache_memory': 256 << 20}))
    eng, g = llm.engine, torch.Generator().manual_seed(1)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sp = SamplingParams(temperature=0, max_tokens=O, ignore_eos=True, detokenize=False)
    new = lambda: eng.add_request(None, {'prompt_token_ids': torch.randint(100, eng.vocab_size, (P,), generator=g).tolist()}, sp)
    sp.max_tokens = 16
    for _ in range(2):   # warm-up rounds on other prompts, as the server benchmark does
        for _ in range(C): new()
        while eng.has_unfinished_requests(): eng.step()      # step(), not step_parents(): it forgets finished requests
    sp.max_tokens = O
    compiles.clear()
    live, sent, steps = set(), 0, []
    while sent < C: live.add(new()); sent += 1
    t_start = time.perf_counter()
    while live:
        n_c = len(compiles)
        sync(); t = time.perf_counter()
        outs = eng.step()
        sync(); dt = time.perf_counter() - t
        sched = eng.last_scheduled or []
        pre = sum(1 for r in sched if r.num_output_tokens <= 1)   # prefilling, or its first token just made
        steps.append(dict(t=t - t_start, ms=1e3 * dt, seqs=len(sched), prefills=pre, compiles=compiles[n_c:]))
        for i in [o.request_id for o in outs if o.finished]:
            live.discard(i)
            if sent < N: live.add(new()); sent += 1
    total = time.perf_counter() - t_start
    print(f'{model} C={C} N={N} {P}->{O}: {len(steps)} steps in {total:.2f} s, {N * O / total:.0f} output tok/s')
    kinds = collections.defaultdict(list)
    for s in steps: kinds['mixed' if s['prefills'] else 'decode'].append(s['ms'])
    for k, v in kinds.items():
        v = sorted(v); print(f'{k:7s} steps {len(v):5d}  p50 {v[len(v) // 2]:7.1f} ms  p90 {v[int(len(v) * .9)]:7.1f}  max {v[-1]:7.1f}')
    print('slowest steps:')
    for s in sorted(steps, key=lambda s: -s['ms'])[:15]:
        print(f"  t={s['t']:7.3f}s {s['ms']:7.1f} ms seqs {s['seqs']:3d} prefills {s['prefills']:3d} compiles {s['compiles']}")
    print(f'Triton compiles during the measured run: {sum(len(s["compiles"]) for s in steps)}')

if __name__ == '__main__':
    main(*sys.argv[1:])
