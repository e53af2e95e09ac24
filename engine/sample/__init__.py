"""Sampling: each request's parameters as batch columns (`Sampler.prepare`), the tokens they pick
(`Sampler`), and the logprobs of what was picked (`logprobs`). A new sampling option lives here, in
`SamplingParams` and in the API's protocol, and nowhere else."""
