"""A model at tensor parallel 2 through the engine (CPU, gloo): the same answers as one process.

A tiny random Llama (saved with `save_pretrained` beside a tokenizer, as notebook 55 does; its vocabulary not a
multiple of the ranks' padding, its two KV heads one per rank) runs through `LLM` at tensor parallel 1 and 2 on
the paged, chunked, batched path (small blocks, 8-token prefill chunks, a 16-token step budget: prompts are cut in
chunks and batched with other requests' decode steps). Greedy tokens must be equal and every prompt log-prob
within 1e-4 (fp32). Then the same at tensor parallel 2 as two torchrun "nodes" on the loopback
(`torchrun --nnodes 2 --nproc-per-node 1`): rank 0 runs the engine, rank 1 serves its steps; and `cvllm-serve
--tensor-parallel-size 2` (its engine-core process starting the two workers) answers with the same text.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from cvllm_lab.utils import parallel_state as ps

VOCAB, LENS, MAX_TOKENS = 250, (5, 23, 41, 12), 6
ENGINE = dict(block_size=4, prefill_chunk_size=8, max_num_batched_tokens=16, kv_cache_memory=4 << 20, device='cpu')


def make_model(root: Path) -> Path:
    "A random tiny Llama (norms and biases not at their init values) and a tokenizer, saved as an HF folder."
    from transformers import LlamaConfig, LlamaForCausalLM
    from cvllm_lab.config import default_model_path
    from cvllm_lab.tokenizer import load_tokenizer

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
        attention_bias=True,
        initializer_range=0.1,
        architectures=['LlamaForCausalLM'],
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():  # greedy tokens that differ from step to step and prompt to prompt
            if n.endswith('bias'):
                p.normal_(0, 0.05)
            elif 'norm' in n:
                p.normal_(1, 0.2)
    hf.save_pretrained(root)
    gg = default_model_path()
    load_tokenizer(gg.parent, gg.name).save_pretrained(root)
    return root


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENS]


def run(model: str, tp: int, **kw) -> dict:
    "Greedy tokens and full prompt log-probs of every prompt, one `generate` call (batched)."
    from cvllm_lab import LLM, SamplingParams

    llm = LLM(model, progress=False, tensor_parallel_size=tp, **{**ENGINE, **kw})
    try:
        outs = llm.generate(
            prompts(),
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, prompt_logprobs=-1, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        llm.engine.shutdown()
    return dict(
        tokens=[o.outputs[0].token_ids for o in outs],
        texts=[o.outputs[0].text for o in outs],
        prompt_logprobs=[[[d[t].logprob for t in range(VOCAB)] for d in o.prompt_logprobs[1:]] for o in outs],
    )


def check_same(got: dict, ref: dict, atol: float = 1e-4):
    assert got['tokens'] == ref['tokens']
    assert (
        all(len(t) == MAX_TOKENS for t in got['tokens']) and len({x for t in got['tokens'] for x in t}) > 4
    )  # not one token
    for g, r in zip(got['prompt_logprobs'], ref['prompt_logprobs']):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(r), atol=atol, rtol=0)


@pytest.fixture(scope='module')
def model_and_ref():
    with tempfile.TemporaryDirectory() as d:
        model = str(make_model(Path(d)))
        yield model, run(model, 1)


def test_tp2_matches_tp1_through_the_engine(model_and_ref):
    model, ref = model_and_ref
    got = run(model, 2)
    check_same(got, ref)
    flat = torch.tensor(sum(ref['prompt_logprobs'], []))
    assert flat.shape == (sum(LENS) - len(LENS), VOCAB) and torch.isfinite(flat).all()


@pytest.mark.cuda
def test_tp2_on_two_gpus_matches_tp1(model_and_ref):
    "Two GPU workers over NCCL (CUDA graphs captured per rank, Triton kernels) against one GPU, fp32."
    if torch.cuda.device_count() < 2:
        pytest.skip('needs 2 GPUs')
    model, _ = model_and_ref
    gpu = dict(device='cuda', dtype='float32')
    check_same(run(model, 2, **gpu), run(model, 1, **gpu, async_scheduling=False), atol=1e-3)


def _torchrun_main(model: str, out: str):
    "Every torchrun rank: build the engine (rank 1 serves rank 0's steps inside it, then exits); rank 0 writes the answer."
    res = run(model, int(os.environ['WORLD_SIZE']))
    Path(out).write_text(json.dumps(res))


def test_two_nodes_with_torchrun_match_tp1(model_and_ref, tmp_path):
    "`torchrun --nnodes 2 --nproc-per-node 1 --node-rank R` twice on the loopback: the multi-node launch."
    model, ref = model_and_ref
    port, out = ps.free_port(), tmp_path / 'tp2.json'
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                '-m',
                'torch.distributed.run',
                '--nnodes',
                '2',
                '--nproc-per-node',
                '1',
                '--node-rank',
                str(r),
                '--master-addr',
                '127.0.0.1',
                '--master-port',
                str(port),
                __file__,
                '--torchrun',
                model,
                str(out),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    check_same(json.loads(out.read_text()), ref)


def test_serve_tp2_answers_as_tp1(model_and_ref):
    "The OpenAI server at -tp 2: the engine-core process spawns the workers; greedy completions equal TP 1's, then all exit."
    import httpx

    sys.path.insert(0, os.path.dirname(__file__))
    from _serverproc import ServerProcess

    model, ref = model_and_ref
    with ServerProcess(
        '--model',
        model,
        '-tp',
        '2',
        '--device',
        'cpu',
        '--block-size',
        '4',
        '--mem',
        '4',
        '--max-model-len',
        '256',
        '--prefill-chunk-size',
        '8',
        '--max-num-batched-tokens',
        '16',
    ) as s:
        for p, want in zip(prompts(), ref['texts']):
            r = httpx.post(
                s.url + '/v1/completions',
                json=dict(model=Path(model).name, prompt=p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                timeout=60,
            )
            assert r.status_code == 200, r.text
            assert r.json()['choices'][0]['text'] == want
        pgid = s.proc.pid
    deadline = time.monotonic() + 30  # the engine core and both workers exit too
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f'processes of the server group {pgid} still alive 30 s after it stopped')


if __name__ == '__main__' and '--torchrun' in sys.argv:
    i = sys.argv.index('--torchrun')
    _torchrun_main(sys.argv[i + 1], sys.argv[i + 2])
