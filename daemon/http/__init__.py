"""The HTTP layer: aiohttp routes (`api.py`), the OpenAI wire format (`openai_wire.py`,
`openai_responses.py`), the edge checks every request passes (`edge.py`), the web chat
(`webchat.py`, `static/`) and the server's start-up and shutdown (`server.py`). It
translates between HTTP and the engine; it does not think."""
