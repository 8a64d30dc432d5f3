"""The wire: message kinds and schemas, the codec, packed arrays, socket security, the mailbox."""
