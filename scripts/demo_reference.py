"""Run the fp32 reference ops on a small packed batch and print what they return."""
import torch

from cp_linattn import kda_gate, naive_recurrent_gla, naive_recurrent_kda
from cp_linattn.ops.kda.naive import l2norm


def main() -> None:
    torch.manual_seed(0)
    cu_seqlens = torch.tensor([0, 5, 12, 20])
    T, H, K, V = 20, 2, 8, 8
    q, k = l2norm(torch.randn(1, T, H, K)), l2norm(torch.randn(1, T, H, K))
    v = torch.randn(1, T, H, V)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, H, K))
    o, ht = naive_recurrent_gla(q, k, v, g, output_final_state=True, cu_seqlens=cu_seqlens)
    print(f"GLA: o {tuple(o.shape)}, final states {tuple(ht.shape)}, |o| = {o.norm():.4f}")
    g_kda = kda_gate(torch.randn(1, T, H, K), A_log=torch.zeros(H), dt_bias=torch.zeros(H * K))
    o, ht = naive_recurrent_kda(q, k, v, g_kda, torch.rand(1, T, H), output_final_state=True, cu_seqlens=cu_seqlens)
    print(f"KDA: o {tuple(o.shape)}, final states {tuple(ht.shape)}, |o| = {o.norm():.4f}")


if __name__ == "__main__":
    main()
