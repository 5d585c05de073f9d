// JsonFields (runtime/core/json_fields.h): typed reads, and errors naming the source, the full field path, the type
// expected and the value found, for missing fields, wrong types, out-of-range integers and nested paths.
#include "runtime/core/json_fields.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

namespace nflash {
namespace {

using nlohmann::json;

const char* kDoc = R"({
  "name": "m", "count": 3, "neg": -2, "big": 5000000000, "ratio": 0.5, "whole": 2.0, "flag": true,
  "limits": {"memory_bytes": 1024, "cores": "two"},
  "regions": [{"layer": 0}, {"layer": "one"}, {}],
  "empty": []
})";

JsonFields Root(const json& j) { return JsonFields::Of(j, JsonLocation("plan.json")).value(); }

// The message of a failed status (empty when it did not fail, so EXPECT_EQ shows what happened).
std::string Error(const Status& s) { return s.ok() ? "" : s.message(); }

TEST(JsonFieldsTest, ReadsTypedValues) {
  const json j = json::parse(kDoc);
  JsonFields f = Root(j);
  std::string name;
  int64_t count = 0, neg = 0, big = 0;
  uint64_t ubig = 0;
  double ratio = 0, whole = 0;
  int small = 0;
  bool flag = false;
  ASSERT_TRUE(f.Get("name", &name).ok());
  ASSERT_TRUE(f.Get("count", &count).ok());
  ASSERT_TRUE(f.Get("count", &small).ok());
  ASSERT_TRUE(f.Get("neg", &neg).ok());
  ASSERT_TRUE(f.Get("big", &big).ok());
  ASSERT_TRUE(f.Get("big", &ubig).ok());
  ASSERT_TRUE(f.Get("ratio", &ratio).ok());
  ASSERT_TRUE(f.Get("whole", &whole).ok());
  ASSERT_TRUE(f.Get("count", &ratio).ok());  // an integer is a number
  ASSERT_TRUE(f.Get("flag", &flag).ok());
  EXPECT_EQ(name, "m");
  EXPECT_EQ(count, 3);
  EXPECT_EQ(small, 3);
  EXPECT_EQ(neg, -2);
  EXPECT_EQ(big, 5000000000);
  EXPECT_EQ(ubig, 5000000000u);
  EXPECT_EQ(ratio, 3.0);
  EXPECT_EQ(whole, 2.0);
  EXPECT_TRUE(flag);
  EXPECT_TRUE(f.Has("limits"));
  EXPECT_FALSE(f.Has("nothing"));
}

TEST(JsonFieldsTest, MissingField) {
  const json j = json::parse(kDoc);
  int64_t v = 0;
  EXPECT_EQ(Error(Root(j).Get("schema_version", &v)), "plan.json: missing field 'schema_version'");
  const Status s = Root(j).Get("schema_version", &v);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_EQ(v, 0);  // untouched on error
}

TEST(JsonFieldsTest, WrongType) {
  const json j = json::parse(kDoc);
  JsonFields f = Root(j);
  int64_t i = 0;
  uint32_t u = 0;
  std::string s;
  double d = 0;
  bool b = false;
  EXPECT_EQ(Error(f.Get("name", &i)), "plan.json: field 'name' has the wrong type: expected an integer, found \"m\"");
  EXPECT_EQ(Error(f.Get("ratio", &u)),
            "plan.json: field 'ratio' has the wrong type: expected a non-negative integer, found 0.5");
  // 2.0 is a JSON float: an integer field must be written as one.
  EXPECT_EQ(Error(f.Get("whole", &i)), "plan.json: field 'whole' has the wrong type: expected an integer, found 2.0");
  EXPECT_EQ(Error(f.Get("count", &s)), "plan.json: field 'count' has the wrong type: expected a string, found 3");
  EXPECT_EQ(Error(f.Get("name", &d)), "plan.json: field 'name' has the wrong type: expected a number, found \"m\"");
  EXPECT_EQ(Error(f.Get("count", &b)), "plan.json: field 'count' has the wrong type: expected true or false, found 3");
  EXPECT_EQ(Error(f.Object("name").status()),
            "plan.json: field 'name' has the wrong type: expected an object, found \"m\"");
  EXPECT_EQ(Error(f.Array("limits").status()),
            "plan.json: field 'limits' has the wrong type: expected an array, found {\"cores\":\"two\",\"memory_bytes\":1024}");
  EXPECT_EQ(Error(JsonFields::Of(json::parse("[1]"), JsonLocation("hw.json")).status()),
            "hw.json: expected a JSON object, found [1]");
}

TEST(JsonFieldsTest, OutOfRangeInteger) {
  const json j = json::parse(kDoc);
  JsonFields f = Root(j);
  int32_t i32 = 0;
  uint64_t u64 = 0;
  uint8_t u8 = 0;
  EXPECT_EQ(Error(f.Get("big", &i32)),
            "plan.json: field 'big' is out of range: expected an integer in [-2147483648, 2147483647], found 5000000000");
  EXPECT_EQ(Error(f.Get("neg", &u64)),
            "plan.json: field 'neg' is out of range: expected an integer in [0, 18446744073709551615], found -2");
  EXPECT_EQ(Error(f.Get("big", &u8)), "plan.json: field 'big' is out of range: expected an integer in [0, 255], found 5000000000");
  EXPECT_EQ(i32, 0);
  EXPECT_EQ(u8, 0);
  // The extremes themselves are in range.
  const json edge = json::parse(R"({"max": 18446744073709551615, "min": -9223372036854775808})");
  int64_t min = 0;
  ASSERT_TRUE(Root(edge).Get("max", &u64).ok());
  ASSERT_TRUE(Root(edge).Get("min", &min).ok());
  EXPECT_EQ(u64, UINT64_MAX);
  EXPECT_EQ(min, INT64_MIN);
  EXPECT_EQ(Error(Root(edge).Get("max", &min)), "plan.json: field 'max' is out of range: expected an integer in "
                                                "[-9223372036854775808, 9223372036854775807], found 18446744073709551615");
}

TEST(JsonFieldsTest, NestedPathsInMessages) {
  const json j = json::parse(kDoc);
  JsonFields f = Root(j);
  auto limits = f.Object("limits");
  ASSERT_TRUE(limits.ok());
  int cores = 0;
  uint64_t mem = 0;
  ASSERT_TRUE(limits->Get("memory_bytes", &mem).ok());
  EXPECT_EQ(mem, 1024u);
  EXPECT_EQ(Error(limits->Get("cores", &cores)),
            "plan.json: field 'limits.cores' has the wrong type: expected an integer, found \"two\"");
  EXPECT_EQ(Error(limits->Get("objective", &cores)), "plan.json: missing field 'limits.objective'");
  EXPECT_EQ(Error(f.Object("settings").status()), "plan.json: missing field 'settings'");

  auto regions = f.Array("regions", 1);
  ASSERT_TRUE(regions.ok());
  const JsonLocation at = f.where().Field("regions");
  int64_t layer = -1;
  ASSERT_TRUE(JsonFields::Of((**regions)[0], at.Index(0))->Get("layer", &layer).ok());
  EXPECT_EQ(layer, 0);
  EXPECT_EQ(Error(JsonFields::Of((**regions)[1], at.Index(1))->Get("layer", &layer)),
            "plan.json: field 'regions[1].layer' has the wrong type: expected an integer, found \"one\"");
  EXPECT_EQ(Error(JsonFields::Of((**regions)[2], at.Index(2))->Get("layer", &layer)),
            "plan.json: missing field 'regions[2].layer'");
  EXPECT_EQ(Error(JsonFields::Of(json(5), at.Index(3)).status()),
            "plan.json: field 'regions[3]': expected an object, found 5");
  EXPECT_EQ(Error(f.Array("empty", 1).status()), "plan.json: field 'empty': expected at least 1 element(s), found 0");
  EXPECT_TRUE(f.Array("empty").ok());
}

// A value shown in an error is cut at 80 characters of its JSON text ("..." after), so that a large array or object
// does not flood the message; a short one is shown whole.
TEST(JsonFieldsTest, LongValuesAreCutInMessages) {
  json j = json::object();
  j["rates"] = json::array();
  for (int i = 0; i < 100; ++i) j["rates"].push_back(1000 + i);  // "[1000,1001,...]": 501 characters
  j["short"] = json::array({1, 2});
  JsonFields f = Root(j);
  std::string text;
  const std::string cut = j["rates"].dump().substr(0, 80) + "...";
  EXPECT_EQ(Error(f.Get("rates", &text)), "plan.json: field 'rates' has the wrong type: expected a string, found " + cut);
  EXPECT_EQ(Error(f.Get("short", &text)), "plan.json: field 'short' has the wrong type: expected a string, found [1,2]");
}

// JSON built in code can hold a signed positive integer (parsed text gives unsigned ones): the upper bound applies
// to it as well.
TEST(JsonFieldsTest, SignedValuesBuiltInCodeAreCheckedAgainstTheUpperBound) {
  json j = json::object();
  j["big"] = int64_t{5000000000};
  ASSERT_TRUE(j["big"].is_number_integer() && !j["big"].is_number_unsigned());
  JsonFields f = Root(j);
  int small = 0;
  EXPECT_EQ(Error(f.Get("big", &small)),
            "plan.json: field 'big' is out of range: expected an integer in [-2147483648, 2147483647], found 5000000000");
  int64_t wide = 0;
  EXPECT_EQ(Error(f.Get("big", &wide)), "");
  EXPECT_EQ(wide, 5000000000);
}

}  // namespace
}  // namespace nflash
