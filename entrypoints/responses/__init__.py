"""OpenAI's Responses API (/v1/responses), on the request path every API shares."""
