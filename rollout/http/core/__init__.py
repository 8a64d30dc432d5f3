"""What every route shares: the front's state and checks, the client, request bodies, sampling,
log-probs, structured outputs, chat sessions and tool calls, errors, guards, metrics."""
