"""The OpenAI-compatible gateway: endpoint picking, rate limits, admission and the HTTP proxy."""
