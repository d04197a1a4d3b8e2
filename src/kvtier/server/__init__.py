"""`kvtier serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) around the Engine."""
