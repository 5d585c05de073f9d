// plan.json reading and writing (schema in docs/planner.md).
#include "planner/plan.h"

#include <nlohmann/json.hpp>

#include "runtime/core/checksum.h"
#include "runtime/core/file.h"
#include "runtime/core/json_fields.h"

namespace nflash::planner {

using nlohmann::json;

std::string PlanToJson(const Plan& p) {
  json j;
  j["schema_version"] = p.schema_version;
  j["deployment_hash"] = p.deployment_hash;
  j["hardware_hash"] = p.hardware_hash;
  j["model_name"] = p.model_name;
  j["limits"] = {{"memory_bytes", p.memory_limit_bytes},
                 {"cores", p.cores},
                 {"min_tokens_per_s", p.min_tokens_per_s},
                 {"objective", p.objective}};
  j["settings"] = {{"fixed_bytes", p.fixed_bytes},         {"n_ctx", p.n_ctx}, {"kv_type", p.kv_type},
                   {"compute_threads", p.compute_threads}, {"io_threads", p.io_threads},
                   {"queue_depth", p.queue_depth},         {"cluster_neurons", p.cluster_neurons},
                   {"shared_cold_pool", p.shared_cold_pool}, {"lookahead", p.lookahead}};
  json regions = json::array();
  for (const RegionPlan& r : p.regions) {
    regions.push_back(
        {{"layer", r.layer}, {"expert", r.expert}, {"hot_neurons", r.hot_neurons}, {"cold_slots", r.cold_slots}});
  }
  j["regions"] = regions;
  const PlanPrediction& q = p.predicted;
  j["predicted"] = {{"attention_s", q.attention_s},
                    {"predictor_s", q.predictor_s},
                    {"ffn_compute_s", q.ffn_compute_s},
                    {"io_s", q.io_s},
                    {"io_exposed_s", q.io_exposed_s},
                    {"pipeline_s", q.pipeline_s},
                    {"token_s", q.token_s},
                    {"tokens_per_s", q.tokens_per_s},
                    {"served_fraction", q.served_fraction},
                    {"read_mb_per_token", q.read_mb_per_token},
                    {"reads_per_token", q.reads_per_token},
                    {"prefill128_tokens_per_s", q.prefill128_tokens_per_s},
                    {"prefill512_tokens_per_s", q.prefill512_tokens_per_s},
                    {"memory_bytes", q.memory_bytes}};
  if (p.calibration.present()) {
    const Calibration& c = p.calibration;
    j["calibration"] = {{"compute_scale", c.compute_scale},
                        {"io_scale", c.io_scale},
                        {"measured_token_s", c.measured_token_s},
                        {"measured_io_wait_s", c.measured_io_wait_s},
                        {"uncalibrated_token_s", c.uncalibrated_token_s},
                        {"tokens", c.tokens},
                        {"runs", c.runs},
                        {"memory_bytes", c.memory_bytes}};
    if (c.lookahead_compared()) {
      j["calibration"]["lookahead_on_token_s"] = c.lookahead_on_token_s;
      j["calibration"]["lookahead_off_token_s"] = c.lookahead_off_token_s;
    }
  }
  j["solve_seconds"] = p.solve_seconds;
  return j.dump(2) + "\n";
}

Result<Plan> ParsePlan(const std::string& text, const std::string& source) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::Corruption(source + ": not valid JSON");
  NF_ASSIGN_OR_RETURN(const JsonFields root, JsonFields::Of(j, JsonLocation(source)));
  Plan p;
  NF_RETURN_IF_ERROR(root.Get("schema_version", &p.schema_version));
  if (p.schema_version != kPlanSchemaVersion) {
    return Status::Unsupported(source + ": field 'schema_version': expected " + std::to_string(kPlanSchemaVersion) +
                               ", found " + std::to_string(p.schema_version));
  }
  NF_RETURN_IF_ERROR(root.Get("deployment_hash", &p.deployment_hash));
  NF_RETURN_IF_ERROR(root.Get("hardware_hash", &p.hardware_hash));
  NF_RETURN_IF_ERROR(root.Get("model_name", &p.model_name));
  NF_ASSIGN_OR_RETURN(const JsonFields lim, root.Object("limits"));
  NF_RETURN_IF_ERROR(lim.Get("memory_bytes", &p.memory_limit_bytes));
  NF_RETURN_IF_ERROR(lim.Get("cores", &p.cores));
  NF_RETURN_IF_ERROR(lim.Get("min_tokens_per_s", &p.min_tokens_per_s));
  NF_RETURN_IF_ERROR(lim.Get("objective", &p.objective));
  NF_ASSIGN_OR_RETURN(const JsonFields set, root.Object("settings"));
  NF_RETURN_IF_ERROR(set.Get("fixed_bytes", &p.fixed_bytes));
  NF_RETURN_IF_ERROR(set.Get("n_ctx", &p.n_ctx));
  if (set.Has("kv_type")) NF_RETURN_IF_ERROR(set.Get("kv_type", &p.kv_type));
  if (p.kv_type != "f32" && p.kv_type != "f16") {  // KvTypeName's names
    return Status::Corruption(source + ": field 'settings.kv_type': expected \"f32\" or \"f16\", found \"" + p.kv_type +
                              "\"");
  }
  NF_RETURN_IF_ERROR(set.Get("compute_threads", &p.compute_threads));
  NF_RETURN_IF_ERROR(set.Get("io_threads", &p.io_threads));
  NF_RETURN_IF_ERROR(set.Get("queue_depth", &p.queue_depth));
  NF_RETURN_IF_ERROR(set.Get("cluster_neurons", &p.cluster_neurons));
  if (set.Has("shared_cold_pool")) NF_RETURN_IF_ERROR(set.Get("shared_cold_pool", &p.shared_cold_pool));
  if (set.Has("lookahead")) NF_RETURN_IF_ERROR(set.Get("lookahead", &p.lookahead));
  if (p.lookahead < -1) {
    return Status::Corruption(source + ": field 'settings.lookahead': expected -1 (the runtime's rule), 0 (off) or " +
                              "a bundle count, found " + std::to_string(p.lookahead));
  }
  if (p.compute_threads < 1 || p.io_threads < 0 || p.queue_depth < 1 || p.cluster_neurons < 1) {
    return Status::Corruption(source + ": 'settings' needs compute_threads >= 1, io_threads >= 0, queue_depth >= 1, " +
                              "cluster_neurons >= 1");
  }
  NF_ASSIGN_OR_RETURN(const json* regions, root.Array("regions"));
  const JsonLocation regions_at = root.where().Field("regions");
  for (size_t i = 0; i < regions->size(); ++i) {
    NF_ASSIGN_OR_RETURN(const JsonFields r, JsonFields::Of((*regions)[i], regions_at.Index(i)));
    RegionPlan rp;
    NF_RETURN_IF_ERROR(r.Get("layer", &rp.layer));
    NF_RETURN_IF_ERROR(r.Get("expert", &rp.expert));
    NF_RETURN_IF_ERROR(r.Get("hot_neurons", &rp.hot_neurons));
    NF_RETURN_IF_ERROR(r.Get("cold_slots", &rp.cold_slots));
    if (rp.hot_neurons < 0 || rp.cold_slots < 0) {
      return Status::Corruption(r.where().Describe() + ": hot_neurons and cold_slots must be >= 0");
    }
    p.regions.push_back(rp);
  }
  NF_ASSIGN_OR_RETURN(const JsonFields q, root.Object("predicted"));
  PlanPrediction& pr = p.predicted;
  for (auto [key, dst] : std::initializer_list<std::pair<const char*, double*>>{
           {"attention_s", &pr.attention_s},
           {"predictor_s", &pr.predictor_s},
           {"ffn_compute_s", &pr.ffn_compute_s},
           {"io_s", &pr.io_s},
           {"io_exposed_s", &pr.io_exposed_s},
           {"pipeline_s", &pr.pipeline_s},
           {"token_s", &pr.token_s},
           {"tokens_per_s", &pr.tokens_per_s},
           {"served_fraction", &pr.served_fraction},
           {"read_mb_per_token", &pr.read_mb_per_token},
           {"reads_per_token", &pr.reads_per_token},
           {"prefill128_tokens_per_s", &pr.prefill128_tokens_per_s},
           {"prefill512_tokens_per_s", &pr.prefill512_tokens_per_s}}) {
    NF_RETURN_IF_ERROR(q.Get(key, dst));
  }
  NF_RETURN_IF_ERROR(q.Get("memory_bytes", &pr.memory_bytes));
  NF_RETURN_IF_ERROR(root.Get("solve_seconds", &p.solve_seconds));
  if (root.Has("calibration")) {
    NF_ASSIGN_OR_RETURN(const JsonFields c, root.Object("calibration"));
    Calibration& k = p.calibration;
    NF_RETURN_IF_ERROR(c.Get("compute_scale", &k.compute_scale));
    NF_RETURN_IF_ERROR(c.Get("io_scale", &k.io_scale));
    NF_RETURN_IF_ERROR(c.Get("measured_token_s", &k.measured_token_s));
    NF_RETURN_IF_ERROR(c.Get("measured_io_wait_s", &k.measured_io_wait_s));
    NF_RETURN_IF_ERROR(c.Get("uncalibrated_token_s", &k.uncalibrated_token_s));
    NF_RETURN_IF_ERROR(c.Get("tokens", &k.tokens));
    NF_RETURN_IF_ERROR(c.Get("memory_bytes", &k.memory_bytes));
    if (c.Has("runs")) NF_RETURN_IF_ERROR(c.Get("runs", &k.runs));  // absent in plans made before it existed: 1
    // Both or neither (absent: the lookahead was not compared).
    if (c.Has("lookahead_on_token_s") || c.Has("lookahead_off_token_s")) {
      NF_RETURN_IF_ERROR(c.Get("lookahead_on_token_s", &k.lookahead_on_token_s));
      NF_RETURN_IF_ERROR(c.Get("lookahead_off_token_s", &k.lookahead_off_token_s));
      if (!k.lookahead_compared()) {
        return Status::Corruption(c.where().Describe() + ": lookahead_on_token_s and lookahead_off_token_s must be > 0");
      }
    }
    if (!(k.compute_scale > 0) || !(k.io_scale > 0) || k.tokens <= 0 || k.runs <= 0) {
      return Status::Corruption(c.where().Describe() +
                                ": compute_scale and io_scale must be > 0, tokens and runs > 0");
    }
  }
  return p;
}

Result<Plan> LoadPlan(const std::string& path) {
  NF_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadWholeFile(path));
  return ParsePlan(std::string(bytes.begin(), bytes.end()), path);
}

Status SavePlan(const Plan& plan, const std::string& path, bool overwrite) {
  NF_ASSIGN_OR_RETURN(auto writer, AtomicFileWriter::Create(path, overwrite));
  const std::string text = PlanToJson(plan);
  NF_RETURN_IF_ERROR(writer->Append(text.data(), text.size()));
  return writer->Commit();
}

Status CheckPlanForDeployment(const Plan& plan, const std::string& deploy_dir) {
  const std::string manifest = deploy_dir + "/manifest.json";
  NF_ASSIGN_OR_RETURN(uint64_t hash, HashFile(manifest));
  const std::string found = HashToHex(hash);
  if (found != plan.deployment_hash) {
    return Status::InvalidArgument("the plan was made for another deployment: its deployment_hash is " +
                                   plan.deployment_hash + " but " + manifest + " hashes to " + found +
                                   " (run `nflash plan` for this deployment)");
  }
  return Status::Ok();
}

}  // namespace nflash::planner
