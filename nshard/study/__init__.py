"""The study: the runner (arms, commitment, scoring, validation, analysis), evaluation and validation."""
