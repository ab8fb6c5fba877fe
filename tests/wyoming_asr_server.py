"""A real Wyoming ASR server (the `wyoming` package) to run as a separate process in fault tests.

``python -m tests.wyoming_asr_server PORT`` serves on 127.0.0.1:PORT, prints ``ready`` once it
listens and ``event TYPE`` for every event it reads (so a test can kill it at a known point), and
answers `audio-stop` with a `transcript`.
"""

from __future__ import annotations

import asyncio
import sys
import warnings

with warnings.catch_warnings():  # wyoming.audio imports audioop, deprecated since Python 3.11
    warnings.simplefilter("ignore", DeprecationWarning)
    from wyoming.asr import Transcript
    from wyoming.audio import AudioStop

from wyoming.event import Event
from wyoming.info import AsrModel, AsrProgram, Attribution, Describe, Info
from wyoming.server import AsyncEventHandler, AsyncTcpServer

TEXT = "turn on the kitchen lights"
_ATTR = Attribution(name="tests", url="http://localhost")
INFO = Info(
    asr=[
        AsrProgram(
            name="test-asr",
            attribution=_ATTR,
            installed=True,
            description=None,
            version="1",
            models=[
                AsrModel(
                    name="test", attribution=_ATTR, installed=True, description=None, version="1", languages=["en"]
                )
            ],
        )
    ]
)


class Handler(AsyncEventHandler):
    async def handle_event(self, event: Event) -> bool:
        print(f"event {event.type}", flush=True)
        if Describe.is_type(event.type):
            await self.write_event(INFO.event())
        elif AudioStop.is_type(event.type):
            await self.write_event(Transcript(TEXT).event())
            return False
        return True


async def main(port: int) -> None:
    server = AsyncTcpServer("127.0.0.1", port)
    await server.start(Handler)
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
