"""Images: multimodal inputs (media placeholders) and the vision encoder's content-hash cache."""
