"""Voice path under LLM load: real whisper and Piper behind the supervisor, three scenarios.

    .venv/bin/python -m bench.voice_path [--rounds 2] [--turns 12] [--period 6] [--quick]

(1) installs the voice stack when missing (its own venv, ~/.cache/genie-supervisor/voice),
(2) starts wyoming-faster-whisper and wyoming-piper on free loopback ports,
(3) makes the utterances' speech with Piper once (cached),
(4) starts the daemon (SmolLM2, CPU engine) with the Wyoming proxy in front of both servers,
(5) runs idle / contention / arbitration, interleaved, `--rounds` times, after a warm-up, and
writes summary.md, results.json and timeline.png under bench/results/voice_path-<date>/ and records
the headline ratios in bench/results/index.json.

    python -m bench.voice_path --gpu [--preset qwen3-4b-q4_k_m] [--stt-size small]

runs the same on a CUDA machine (bench/voice_path/gpu.py): the whisper-shaped GPU STT server
(bench/gpu_stt) in its own process, the daemon's engine on CuPy with an `engine.synth` model,
long-prompt background clients, STT-only; results under bench/results/voice_path_gpu-<date>/,
with summary.json. Every figure is explained in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from .daemon import (
    POLICY_DEFAULT,
    POLICY_OFF,
    ROOT,
    Daemon,
    ProxySettings,
    log_events,
    write_config,
)
from .pipeline import synthesize, transcribe, tts_audio, tts_streaming_supported
from .report import machine, markdown, plot, record_result, summarize, summary_json
from .runner import RunTarget, ScenarioSpec, run_scenario
from .stack import VoiceHome, VoiceStack, start_servers
from .utterances import RATE, UTTERANCES, Utterance, cache_key, read_wav, resample, write_wav

GATE_EVENTS = {"decode_parked", "decode_paused", "decode_resumed", "audio_stop_held", "generation_done"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.voice_path", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=2, help="times the three runs are repeated, interleaved")
    p.add_argument("--turns", type=int, default=10, help="voice turns per run")
    p.add_argument("--period", type=float, default=6.0, help="seconds between the starts of two turns")
    p.add_argument("--scenarios", default="idle,contention,arbitration", help="which runs, in round order")
    p.add_argument(
        "--idle-llm",
        action="store_true",
        help="the idle run's voice turns ask the LLM too (the reference for the voice LLM's time to "
        "first token with no background load); without it they speak the canned reply",
    )
    p.add_argument("--load-clients", type=int, default=2, help="background LLM clients in the load runs")
    p.add_argument("--load-tokens", type=int, default=400, help="max_tokens of each background request")
    p.add_argument("--load-settle", type=float, default=3.0, help="seconds the load runs before the first turn")
    p.add_argument("--voice-max-tokens", type=int, default=32)
    p.add_argument("--llm-deadline", type=float, default=6.0, help="seconds a voice turn waits for its first sentence")
    p.add_argument(
        "--realtime",
        type=float,
        default=1.0,
        help="audio streaming speed (1 = live microphone, 0 = as fast as possible)",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed voice turns before the runs")
    p.add_argument("--policy", type=Path, default=POLICY_DEFAULT, help="policy of the arbitration run")
    p.add_argument("--policy-off", type=Path, default=POLICY_OFF, help="policy of the idle and contention runs")
    p.add_argument(
        "--no-hold", action="store_true", help="whisper proxy: do not hold audio-stop until the engine is parked"
    )
    p.add_argument("--hold-max-ms", type=int, default=250)
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: the demo SmolLM2)")
    p.add_argument(
        "--backend", default="auto", choices=["auto", "numpy", "native", "cupy"], help="the daemon's engine backend"
    )
    p.add_argument("--threads", type=int, default=None, help="engine CPU threads (default: all cores)")
    p.add_argument("--whisper-device", default="cpu", help="cpu or cuda")
    p.add_argument("--compute-type", default="int8", help="faster-whisper compute type (cuda: float16)")
    p.add_argument("--cpu-threads", type=int, default=2, help="whisper CPU threads")
    p.add_argument("--window", type=float, default=40.0, help="seconds of each run shown in the timeline")
    p.add_argument("--out", type=Path, default=None, help="results folder (default bench/results/voice_path-<date>)")
    p.add_argument("--workdir", type=Path, default=None, help="logs and configs (default: a temp folder, kept)")
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="run the bench, servers and daemon at this nice value (e.g. -10 on a shared box; needs root)",
    )
    p.add_argument("--quick", action="store_true", help="1 round x 4 turns, short load: checks the setup")
    g = p.add_argument_group("GPU (--gpu)")
    g.add_argument(
        "--gpu",
        action="store_true",
        help="GPU STT server (bench/gpu_stt), CuPy engine, synthetic model and speech, STT-only",
    )
    g.add_argument("--preset", default="qwen3-4b-q4_k_m", help="engine.synth preset of the LLM (--gpu without --model)")
    g.add_argument("--stt-size", default="small", help="whisper shape of the GPU STT server: tiny, base, small, medium")
    g.add_argument("--stt-device", default="cuda", help="the GPU STT server's torch device")
    g.add_argument(
        "--load-prompt-chars",
        type=int,
        default=None,
        help="context characters in each background prompt (--gpu default 2400, ~1,800 tokens; CPU default 0)",
    )
    g.add_argument("--label", default="", help="a word for the report (e.g. mps-8sm)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.turns, args.load_tokens, args.warmup = 1, 4, 64, 1
    if args.load_prompt_chars is None:
        args.load_prompt_chars = 2400 if args.gpu else 0
    if args.gpu and args.backend == "auto":
        args.backend = "cupy"
    return args


def prepare_audio(stack: VoiceStack, cache: Path, utterances: tuple[Utterance, ...]) -> list[tuple[Utterance, bytes]]:
    """Each utterance as 16 kHz mono PCM, spoken by the TTS server once and cached."""
    cache.mkdir(parents=True, exist_ok=True)
    out = []
    for utt in utterances:
        path = cache / f"{cache_key(utt.text, stack.voice)}.wav"
        if not path.exists():
            pcm, rate = anyio.run(tts_audio, stack.tts_port, utt.text)
            pcm16 = resample(np.frombuffer(pcm, dtype=np.int16), rate, RATE).tobytes()
            write_wav(path, pcm16)
        out.append((utt, read_wav(path)))
    return out


async def warm_up(target: RunTarget, audio: list[tuple[Utterance, bytes]], turns: int) -> None:
    """Untimed requests: whisper's and Piper's lazy initialisation, the first LLM request."""
    import httpx

    from .pipeline import Turn, ask_llm

    async with httpx.AsyncClient(base_url=target.url, timeout=60) as client:
        for i in range(turns):
            utt, pcm = audio[i % len(audio)]
            turn = Turn(utt, stt=await transcribe(target.stt_port, pcm, realtime=0))
            await ask_llm(client, turn, max_tokens=8, deadline_s=60)
            if target.tts_port:
                await synthesize(target.tts_port, turn.spoken, streaming=target.tts_streaming)


async def engine_probe(url: str, prompt_chars: int, max_tokens: int) -> dict[str, Any]:
    """One background-shaped request with nothing else running (non-streaming): the engine's own
    prefill speed and decode step (llama-server timings), the reference beside the pause figures."""
    import httpx

    from .pipeline import long_prompt

    body = {
        "model": "default",
        "max_tokens": min(max_tokens, 128),
        "temperature": 0.0,
        "messages": [{"role": "user", "content": "Probe. " + long_prompt(prompt_chars)}],
    }
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        resp = await client.post("/v1/chat/completions", json=body, headers={"X-Genie-Priority": "background"})
    t = dict(resp.json().get("timings") or {})
    if t.get("predicted_n"):
        t["decode_step_ms"] = t["predicted_ms"] / t["predicted_n"]
    return t


def _hold_counters(daemon: Daemon) -> dict[str, int]:
    """The whisper proxy's counters (connections, upstream failures, audio-stop hold timeouts)."""
    whisper = daemon.status().get("services", {}).get("whisper") or {}
    return {k: int(v) for k, v in (whisper.get("counters") or {}).items()}


def main(
    argv: list[str] | None = None,
    *,
    stack_factory: Callable[[Path], AbstractContextManager[VoiceStack]] | None = None,
    audio_cache: Path | None = None,
    utterances: tuple[Utterance, ...] = UTTERANCES,
    say: Callable[[str], None] = lambda m: print(m, flush=True),
) -> Path:
    """Run the benchmark; returns the results folder. `stack_factory` replaces the real servers (smoke test)."""
    args = parse_args(argv)
    started = time.time()
    if args.nice:  # set before anything starts: every process and thread below inherits it
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or ROOT / "bench" / "results" / (f"voice_path_gpu-{date}" if args.gpu else f"voice_path-{date}")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="genie-voice-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    home = VoiceHome.default()
    gpu_audio: list[tuple[Utterance, bytes]] | None = None
    if args.gpu:
        from .gpu import speech_for, start_gpu_stt, write_transcripts

        gpu_audio = speech_for(utterances)
        transcripts = write_transcripts(work / "transcripts.json", gpu_audio)
        if stack_factory is None:

            def stack_factory(w: Path) -> AbstractContextManager[VoiceStack]:
                return start_gpu_stt(w, transcripts, size=args.stt_size, device=args.stt_device)

    if stack_factory is None:
        home.ensure()

        def stack_factory(w: Path) -> AbstractContextManager[VoiceStack]:
            return start_servers(
                home,
                w,
                cpu_threads=args.cpu_threads,
                whisper_device=args.whisper_device,
                compute_type=args.compute_type,
            )

    model = args.model
    if model is None and args.gpu:
        from .gpu import synth_model

        model = synth_model(work, args.preset)
    elif model is None:
        from genie_supervisor.fetch import fetch

        model = fetch("smollm2")
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    proxy = ProxySettings(not args.no_hold, args.hold_max_ms)
    runs: list[dict[str, Any]] = []
    with stack_factory(work) as stack:
        say(f"[bench] voice stack up: {stack.describe}")
        audio = (
            gpu_audio if gpu_audio is not None else prepare_audio(stack, audio_cache or home.audio_cache, utterances)
        )
        say(f"[bench] {len(audio)} utterances, {sum(len(p) for _, p in audio) / (2 * RATE):.1f} s of speech")
        policy_file = work / "policy-active.yaml"
        policy_file.write_text(args.policy_off.read_text(encoding="utf-8"), encoding="utf-8")
        cfg, http, stt, tts = write_config(
            work / "supervisor.yaml",
            stack,
            model=model,
            policy=policy_file,
            backend=args.backend,
            threads=args.threads,
            proxy=proxy,
        )
        daemon = Daemon(cfg, http, policy_file, work / "daemon.log")
        daemon.start(timeout=600 if args.gpu else 120)
        try:
            say(f"[bench] daemon up at {daemon.url} (log {daemon.log_path})")
            streaming = anyio.run(tts_streaming_supported, tts) if tts else False
            target = RunTarget(daemon.url, stt, tts, streaming, pids={**stack.pids, "supervisor": daemon.pid})
            sampler = None
            if args.gpu:
                from .gpu import GpuSampler

                sampler = GpuSampler(work / "pmon.log").__enter__()
            anyio.run(warm_up, target, audio, args.warmup)
            probe = anyio.run(engine_probe, daemon.url, args.load_prompt_chars, args.load_tokens)
            say(
                f"[bench] engine alone: prompt {probe.get('prompt_n')} tokens at {probe.get('prompt_per_second', 0):.0f} tok/s, "
                f"decode step {probe.get('decode_step_ms', 0):.2f} ms"
            )
            for rnd in range(args.rounds):
                for name in names:
                    policy = args.policy if name == "arbitration" else args.policy_off
                    in_force = daemon.use_policy(policy)
                    spec = ScenarioSpec(
                        name,
                        args.turns,
                        args.period,
                        load_clients=0 if name == "idle" else args.load_clients,
                        load_tokens=args.load_tokens,
                        llm=name != "idle" or args.idle_llm,
                        voice_max_tokens=args.voice_max_tokens,
                        llm_deadline_s=args.llm_deadline,
                        realtime=args.realtime,
                        load_settle_s=args.load_settle,
                        load_prompt_chars=args.load_prompt_chars,
                    )
                    say(f"[bench] round {rnd + 1}/{args.rounds}: {name} (policy {in_force})")
                    before = _hold_counters(daemon)
                    result = anyio.run(run_scenario, spec, target, audio)
                    after = _hold_counters(daemon)
                    result["proxy"] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                    result["round"], result["policy"] = rnd + 1, in_force
                    time.sleep(0.3)  # let the last log lines of the run reach the file
                    result["gate_log"] = log_events(daemon.log_path, result["t0"], result["t1"], GATE_EVENTS)
                    stt_ms = sorted(t["stt"]["latency_ms"] for t in result["turns"] if t["stt"])
                    say(
                        f"[bench]   STT p50 {stt_ms[len(stt_ms) // 2] if stt_ms else float('nan'):.0f} ms, "
                        f"{len(result['load']['token_times'])} background tokens, errors {len(result['errors'])}"
                    )
                    runs.append(result)
            final_status = daemon.status()
            if sampler is not None:
                sampler.__exit__(None, None, None)
        finally:
            daemon.stop()
    summary = summarize(runs)
    stt_server: list[dict[str, Any]] = []
    if args.gpu:
        from .gpu import stt_log

        stt_server = stt_log(work)
    meta = {
        "date": date,
        "machine": machine(),
        "command": " ".join(
            shlex.quote(a)
            for a in [".venv/bin/python", "-m", "bench.voice_path", *(argv if argv is not None else sys.argv[1:])]
        ),
        "stack": stack.describe,
        "model": Path(model).name,
        "backend": args.backend,
        "threads": args.threads or "all cores",
        "policies": {"contention": args.policy_off.name, "arbitration": args.policy.name},
        "proxy": {"hold_audio_stop_until_parked": proxy.hold_audio_stop_until_parked, "hold_max_ms": proxy.hold_max_ms},
        "turns": args.turns,
        "period_s": args.period,
        "realtime": args.realtime,
        "load_clients": args.load_clients,
        "load_tokens": args.load_tokens,
        "rounds": args.rounds,
        "order": names,
        "wall_s": time.time() - started,
        "nice": args.nice,
        "gpu": args.gpu,
        "label": args.label,
        "load_prompt_chars": args.load_prompt_chars,
        "engine_probe": probe,
        "stt_server": next((e for e in stt_server if e.get("event") == "stt_ready"), None),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(markdown(summary, meta), encoding="utf-8")
    (out / "results.json").write_text(
        json.dumps({"meta": meta, "summary": summary, "final_gate": final_status.get("gate"), "runs": runs}, indent=1),
        encoding="utf-8",
    )
    (out / "summary.json").write_text(
        json.dumps(summary_json(summary, meta, stt_server, runs), indent=1), encoding="utf-8"
    )
    plot(runs, out / "timeline.png", window_s=args.window)
    record_result(out, summary, meta)
    if (work / "pmon.log").exists():
        (out / "gpu_pmon.txt").write_bytes((work / "pmon.log").read_bytes()[:2_000_000])
    say(f"[bench] wrote {out}/summary.md, summary.json, timeline.png, results.json (logs in {work})")
    return out


if __name__ == "__main__":
    main()
