"""Example toolq tool modules (`--tools examples.search_tools`)."""
