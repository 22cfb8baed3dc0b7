"""toolq: run an LLM agent's tool calls on a Celery fleet (Responses API in, paired outputs back)."""
