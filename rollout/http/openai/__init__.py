"""OpenAI's routes: models, completions, chat."""
