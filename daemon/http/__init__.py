"""The HTTP layer: aiohttp routes (`api.py`), the completion endpoints (`completions.py`)
and their answers (`streaming.py`), the OpenAI wire format (requests: `openai_wire.py`,
`openai_fields.py`, `openai_tools.py`; errors: `openai_errors.py`; answers:
`openai_responses.py`), the edge checks every request passes (`edge.py`), the web chat
(`webchat.py`, `static/`) and the server's start-up and shutdown (`server.py`). It
translates between HTTP and the engine, which is handed requests admission settled
(daemon/admission.py); it does not think."""
