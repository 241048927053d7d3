from setuptools import find_packages, setup

setup(
    name="gridtron",
    version="0.1.0",
    description="A Megatron-style 3D-parallel (TP x PP x DP) training engine for GPT-style models",
    python_requires=">=3.10",
    packages=find_packages(include=["engine", "engine.*", "models", "models.*", "parallel",
                                    "parallel.*", "kernels", "kernels.*"]),
    install_requires=["torch>=2.7", "numpy", "einops", "safetensors", "tokenizers", "pyyaml", "tqdm"],
    extras_require={
        "dev": ["pytest", "matplotlib", "transformers", "tensorboard", "wandb"],  # HF and dashboard tests
        "plot": ["matplotlib"],
        "tensorboard": ["tensorboard"],  # --tensorboard-dir
        "wandb": ["wandb"],              # --wandb-project
        "hf": ["transformers"],          # loading exported checkpoints in transformers
        "npu": ["torch_npu"],
    },
    entry_points={"console_scripts": ["gridtron-train=engine.training.launch:run_and_exit"]},
)
