"""Run the whisper-shaped STT server.

    python -m bench.gpu_stt --uri tcp://127.0.0.1:10300 [--size small] [--device cuda]
        [--dtype float16] [--transcripts map.json]

Loads the model, runs one warm-up transcription (CUDA context, cuBLAS handles, allocator), and
only then listens, so a client that can connect gets warm latencies. One JSON line per request
on stdout (`stt_done`: mel / encoder / decoder milliseconds, decoder steps).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from functools import partial
from pathlib import Path

from wyoming.server import AsyncServer

from .model import SAMPLE_RATE, WhisperWork
from .server import ServerState, SttHandler


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu_stt", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--uri", required=True, help="tcp://HOST:PORT")
    p.add_argument("--size", default="small", help="whisper shape: tiny, base, small, medium")
    p.add_argument("--device", default="cuda", help="cuda or cpu")
    p.add_argument("--dtype", default=None, help="float16 (cuda default) or float32 (cpu default)")
    p.add_argument("--transcripts", type=Path, default=None, help="JSON {pcm sha256[:16]: reference text}")
    p.add_argument("--warmup", type=int, default=2, help="untimed transcriptions before listening")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    dtype = args.dtype or ("float16" if args.device.startswith("cuda") else "float32")
    work = await asyncio.to_thread(WhisperWork.load, args.size, device=args.device, dtype=dtype)
    for _ in range(args.warmup):
        await asyncio.to_thread(work.run, bytes(2 * SAMPLE_RATE), 8)
    transcripts = json.loads(args.transcripts.read_text(encoding="utf-8")) if args.transcripts else {}
    state = ServerState(work, transcripts)
    server = AsyncServer.from_uri(args.uri)
    print(
        json.dumps(
            {
                "event": "stt_ready",
                "uri": args.uri,
                "size": args.size,
                "device": args.device,
                "dtype": dtype,
                "transcripts": len(transcripts),
                "sms": _sms(args.device),
            }
        ),
        flush=True,
    )
    await server.run(partial(SttHandler, state=state))


def _sms(device: str) -> int | None:
    """Multiprocessors this process sees (under MPS with an active-thread share: its share)."""
    import torch

    if not device.startswith("cuda"):
        return None
    return int(torch.cuda.get_device_properties(torch.device(device)).multi_processor_count)


def main(argv: list[str] | None = None) -> int:
    try:
        asyncio.run(serve(parse_args(argv)))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
