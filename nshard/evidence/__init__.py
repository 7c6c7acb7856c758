"""Evidence: the export manifest, commit-before-score, the content-addressed store (local, S3), the archive."""
