"""A whisper-shaped speech-to-text server on the GPU, speaking Wyoming (for the GPU voice-path bench)."""
