"""all-MiniLM-L6-v2 sentence embeddings per second on the CPU: our `LLM.embed` (the pooling runner, every sentence
packed into steps of the token budget) against `sentence-transformers`' `encode` (batches of 32, padded), both fp32
on the same threads, interleaved in one process: each round runs both back to back over the same sentences, so a
busy machine slows a round alike; medians over `--rounds`. Also checks that the two agree (cosine per sentence).
`python -m benchmarks.cpu_minilm_embed [--rounds 3] [--n 512] [--csv PATH] [--plot PATH]`."""

import argparse
import os
import statistics
import time
import numpy as np
import pandas as pd
import torch
from cvllm_lab import LLM
from cvllm_lab.bench.offline import device_name
from cvllm_lab.config import minilm_model_path

WORDS = (
    'the a man woman child dog cat eats plays runs reads writes food music book park city river guitar piano bread '
    'quickly slowly under over near beautiful old new red green small large today tomorrow because while and'
).split()


def sentences(n: int, seed: int = 0) -> list[str]:
    "`n` sentences of 4 to 40 words (a retrieval corpus's spread of lengths), fixed by `seed`."
    rng = np.random.default_rng(seed)
    return [' '.join(rng.choice(WORDS, rng.integers(4, 41))).capitalize() + '.' for _ in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--n', type=int, default=512)
    ap.add_argument('--csv', default='results/cpu_minilm_embed.csv')
    ap.add_argument('--plot', default='results/cpu_minilm_embed.png')
    a = ap.parse_args()
    from sentence_transformers import SentenceTransformer

    folder, texts = str(minilm_model_path()), sentences(a.n)
    ours = LLM(folder, dtype='float32', progress=False)
    st = SentenceTransformer(folder, device='cpu')
    ours.embed(texts, use_tqdm=False)  # warm both on the same sentences
    st.encode(texts, batch_size=32)
    runs = {'ours': [], 'sentence-transformers': []}
    for _ in range(a.rounds):
        t = time.perf_counter()
        mine = np.array([o.outputs.embedding for o in ours.embed(texts, use_tqdm=False)])
        runs['ours'].append(len(texts) / (time.perf_counter() - t))
        t = time.perf_counter()
        ref = st.encode(texts, batch_size=32, convert_to_numpy=True)
        runs['sentence-transformers'].append(len(texts) / (time.perf_counter() - t))
    ratio = statistics.median(x / y for x, y in zip(runs['ours'], runs['sentence-transformers']))  # per round
    cos = (mine * ref).sum(1) / np.linalg.norm(mine, axis=1) / np.linalg.norm(ref, axis=1)
    tokens = sum(len(ours.get_tokenizer()(x).input_ids) for x in texts)
    commit = os.popen('git rev-parse --short HEAD').read().strip()
    rows = [
        dict(
            bench='cpu_minilm_embed',
            engine=k,
            sentences=len(texts),
            tokens=tokens,
            rounds=a.rounds,
            sentences_per_s=statistics.median(v),
            runs=' '.join(f'{x:.1f}' for x in v),
            threads=torch.get_num_threads(),
            min_cosine=float(cos.min()),
            ours_over_st_median_round=ratio,
            load_avg=os.getloadavg()[0],
            device_name=device_name('cpu'),
            commit=commit,
        )
        for k, v in runs.items()
    ]
    df = pd.DataFrame(rows)
    df.to_csv(a.csv, index=False)
    print(df[['engine', 'sentences_per_s', 'runs', 'min_cosine', 'load_avg']].to_string(index=False))
    print(f'ours / sentence-transformers, median over rounds: {ratio:.2f}')
    if a.plot:
        import matplotlib

        matplotlib.use('Agg')
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3))
        ax.bar(df.engine, df.sentences_per_s, color=['tab:blue', 'tab:gray'])
        ax.set_ylabel('sentences / s')
        ax.set_title(
            f'all-MiniLM-L6-v2, {len(texts)} sentences, fp32, {rows[0]["threads"]} CPU threads\n'
            f'(ours / sentence-transformers per round, median: {ratio:.2f})',
            fontsize=9,
        )
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)


if __name__ == '__main__':
    main()
