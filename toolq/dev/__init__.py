"""Development tools: the benchmarks (`toolq bench`), the scripted fake model, the generated
configuration page. Users reach the fake model through `toolq.testing`."""
