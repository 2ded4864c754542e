"""What the load client itself adds to the latencies it reports: `cvllm_lab.loadgen` against a stand-in server that
answers every streamed completion on a fixed clock (first chunk `--ttft-ms` after the request is read, then one
chunk every `--itl-ms`), so every millisecond above that clock is the client's (and the loopback's).

    python -m benchmarks.loadgen_overhead [--concurrency 64] [--num-prompts 256] [--input-len 1024] [--output-len 256]

The stand-in is raw asyncio (no framework) in a child process; each chunk carries the server's send time
(`time.perf_counter`, the same monotonic clock in both processes), and the client's arrival time of each chunk is
compared with it. Prints, per client back end, the run's TTFT / ITL / end-to-end percentiles next to the clock's,
the closed loop's duration against its ideal, and the delivery lag percentiles (chunk received - chunk sent).
"""

from __future__ import annotations
import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import time


def _serve(port: int, ttft: float, itl: float, ready):
    "The stand-in server: HTTP/1.1 keep-alive, chunked SSE, one task per connection."

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            while True:
                head = await reader.readuntil(b'\r\n\r\n')
                n = next(int(l.split(b':')[1]) for l in head.split(b'\r\n') if l.lower().startswith(b'content-length'))
                body = json.loads(await reader.readexactly(n))
                t0 = time.perf_counter()
                writer.write(
                    b'HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n'
                )

                def chunk(payload: str):
                    data = f'data: {payload}\n\n'.encode()
                    writer.write(b'%x\r\n%s\r\n' % (len(data), data))

                for k in range(body['max_tokens']):
                    await asyncio.sleep(max(0.0, t0 + ttft + k * itl - time.perf_counter()))
                    chunk(json.dumps({'choices': [{'index': 0, 'text': 'x'}], 't': time.perf_counter()}))
                    await writer.drain()
                chunk(
                    json.dumps(
                        {
                            'choices': [],
                            'usage': {'prompt_tokens': len(body['prompt']), 'completion_tokens': body['max_tokens']},
                        }
                    )
                )
                chunk('[DONE]')
                writer.write(b'0\r\n\r\n')
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main():
        srv = await asyncio.start_server(handle, '127.0.0.1', port, backlog=1024)
        ready.set()
        async with srv:
            await srv.serve_forever()

    asyncio.run(main())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--concurrency', type=int, default=64)
    ap.add_argument('--num-prompts', type=int, default=256)
    ap.add_argument('--input-len', type=int, default=1024)
    ap.add_argument('--output-len', type=int, default=256)
    ap.add_argument('--ttft-ms', type=float, default=100.0)
    ap.add_argument('--itl-ms', type=float, default=7.0)
    a = ap.parse_args()
    from cvllm_lab.bench.loadgen import run_load_async

    port, ready = free_port(), mp.Event()
    srv = mp.Process(target=_serve, args=(port, a.ttft_ms / 1e3, a.itl_ms / 1e3, ready), daemon=True)
    srv.start()
    ready.wait(30)
    try:
        rep = asyncio.run(
            run_load_async(
                f'http://127.0.0.1:{port}/v1',
                'stand-in',
                'completions',
                a.concurrency,
                a.num_prompts,
                progress=False,
                prompt_tokens=a.input_len,
                max_tokens=a.output_len,
                ignore_eos=True,
                dataset='random',
                vocab_size=32000,
            )
        )
    finally:
        srv.kill()
    waves = -(-a.num_prompts // a.concurrency)
    ideal = waves * (a.ttft_ms + (a.output_len - 1) * a.itl_ms) / 1e3
    e2e = a.ttft_ms + (a.output_len - 1) * a.itl_ms
    print(f'clock: TTFT {a.ttft_ms:.1f} ms, ITL {a.itl_ms:.1f} ms, e2e {e2e:.0f} ms; closed loop ideal {ideal:.2f} s')
    print(
        f'client: TTFT p50 {rep["ttft_ms_p50"]:.1f} / p99 {rep["ttft_ms_p99"]:.1f} ms, ITL p50 {rep["itl_ms_p50"]:.2f} / '
        f'p99 {rep["itl_ms_p99"]:.2f} ms, e2e p50 {rep["e2e_ms_p50"]:.0f} ms; run {rep["duration_s"]:.2f} s '
        f'({rep["duration_s"] / ideal:.3f}x ideal), {rep["output_throughput"]:.0f} tok/s, failed {rep["failed"]}'
    )


if __name__ == '__main__':
    main()
