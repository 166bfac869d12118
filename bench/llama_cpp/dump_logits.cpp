// Evaluate token ids (argv[2], comma-separated) with a GGUF model (argv[1]); write all positions' logits
// as float32 to argv[3]. Single sequence, one batch, all logits.
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
int main(int argc, char ** argv) {
    if (argc < 4) { fprintf(stderr, "usage: model ids out [threads]\n"); return 1; }
    std::vector<llama_token> ids;
    std::string s = argv[2];
    size_t p = 0;
    while (p < s.size()) { size_t q = s.find(',', p); if (q == std::string::npos) q = s.size(); ids.push_back(atoi(s.substr(p, q - p).c_str())); p = q + 1; }
    llama_backend_init();
    auto mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 1; }
    auto cp = llama_context_default_params();
    cp.n_ctx = ids.size() + 8; cp.n_batch = ids.size(); cp.n_ubatch = ids.size();
    cp.n_threads = cp.n_threads_batch = argc > 4 ? atoi(argv[4]) : 1;
    llama_context * ctx = llama_init_from_model(model, cp);
    llama_batch b = llama_batch_init(ids.size(), 0, 1);
    for (size_t i = 0; i < ids.size(); i++) { b.token[i] = ids[i]; b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = 1; }
    b.n_tokens = ids.size();
    if (llama_decode(ctx, b) != 0) { fprintf(stderr, "decode failed\n"); return 1; }
    int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE * f = fopen(argv[3], "wb");
    for (size_t i = 0; i < ids.size(); i++) fwrite(llama_get_logits_ith(ctx, i), sizeof(float), n_vocab, f);
    fclose(f);
    fprintf(stderr, "wrote %zu x %d logits\n", ids.size(), n_vocab);
    return 0;
}
