"""Voice-path benchmark: STT/TTS latency under LLM load, on a real voice stack (see __main__)."""
