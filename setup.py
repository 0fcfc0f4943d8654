"""Rollplex-Megatron: cross-phase GPU sharing for VLM RL post-training on Megatron-Core."""
from setuptools import find_packages, setup

setup(
    name="rollplex_megatron",
    version="0.1.0",
    description="Rollplex runtime for GRPO post-training of vision-language models on Megatron-Core",
    packages=find_packages(include=["rollplex_megatron", "rollplex_megatron.*"]),
    python_requires=">=3.11",
    install_requires=[
        "torch>=2.11",
        "triton>=3.6",  # the decode kernels (torch's CUDA wheels ship it; CPU machines run its interpreter in tests)
        "megatron-core>=0.16.1",
        "hydra-core>=1.3.2",
        "transformers>=5.0",
        "safetensors",
        "tqdm",
        "matplotlib",
        "pyarrow",
        "av",
        "pillow",
        "tensorboard",
    ],
    extras_require={"test": ["pytest"]},
    entry_points={"console_scripts": ["rollplex=rollplex_megatron.__main__:main"],
                  # SGLang (0.5.12 and later) runs this in every process, its schedulers included; the hooks do
                  # nothing unless a trainer set ROLLPLEX_SGLANG_BRIDGE (rollout.engine=sglang)
                  "sglang.srt.plugins": ["rollplex=rollplex_megatron.rollout.sglang.plugin:register"],
                  # verl (0.9.x) imports this module at `import verl` in every process: it registers the engine
                  # vendor `rollplex` (VERL_ENGINE_VENDOR=rollplex) and the v1 trainer `rollplex`
                  "verl.plugins": ["rollplex=rollplex_megatron.integrations.verl.plugin"]},
    include_package_data=True,
)
